"""The actor side: ms-swift's ``CheckpointEngineMixin`` seam, each sync's intent, install().

ms-swift's manager calls ``prepare_checkpoint_engine`` / ``init_checkpoint_process_group`` /
``finalize_checkpoint_engine`` (the mixin's, unchanged) and the actors' own
``send_checkpoint_weights(adapter_only)`` and ``receive_checkpoint_weights(base_sync_done,
peft_config)``; all of them reach the engine through ``_get_or_create_checkpoint_engine``.
The wrappers here tell the engine what each sync is (full or adapter-only), a rollout's
objection to the peft config and how it checks a weight layout, and trainer rank 0's
metadata-only description of its weights where the actor has one
(``weightsync_describe_weights``, on every sending trainer rank: its own part), before
ms-swift's own method runs, so trainer rank 0 can refuse a bad sync for everybody before
any byte moves (:mod:`.layout`).
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import re
from typing import Any, Optional

from swift.ray.megatron.checkpoint_engine import CheckpointEngineMixin as SwiftMixin

from weightsync.integrations.swift.engine import WeightsyncSwiftEngine, describe_actor, new_engine
from weightsync.integrations.swift.layout import default_check_weights

__all__ = ["WeightsyncCheckpointMixin", "install", "uninstall", "peft_config_problems",
           "engine_of"]

logger = logging.getLogger(__name__)
#: vLLM fuses these projections (``qkv_proj``, ``gate_up_proj``) in its parameter names.
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def peft_config_problems(peft_config: Any, param_names: list[str]) -> list[str]:
    """What in ``peft_config`` (PEFT's config as a dict) does not fit a model with these
    parameter names (HF's, or vLLM's fused ones); ``[]`` when it fits."""
    if not isinstance(peft_config, dict):
        return [f"peft_config must be a dict, got {type(peft_config).__name__}"]
    out = []
    r = peft_config.get("r")
    if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
        out.append(f"peft_config r={r!r} is not a positive int")
    modules = {n[: -len(".weight")] for n in param_names if n.endswith(".weight")}
    modules |= {m.replace(".base_layer", "") for m in modules}
    leaves = {m.rsplit(".", 1)[-1] for m in modules}
    targets = peft_config.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        if not any(re.fullmatch(targets, m) for m in modules):
            out.append(f"target_modules {targets!r} matches no module of the rollout model")
    elif isinstance(targets, (list, tuple, set)):
        bad = sorted(str(t) for t in targets if t != "all-linear" and t not in leaves
                     and _FUSED.get(t) not in leaves
                     and not any(m.endswith("." + str(t)) for m in modules))
        if bad:
            out.append(f"target_modules {bad} are not modules of the rollout model")
    return out


def engine_of(actor: Any) -> WeightsyncSwiftEngine:
    """The actor's weightsync engine, created on first use (``weightsync_backend`` and
    ``weightsync_options`` of the actor, else ``WEIGHTSYNC_SWIFT_BACKEND`` / ``WEIGHTSYNC_*``)."""
    engine = actor.__dict__.get("_checkpoint_engine")
    if not isinstance(engine, WeightsyncSwiftEngine):
        if engine is not None and hasattr(engine, "finalize"):
            engine.finalize()
        engine = new_engine(getattr(actor, "weightsync_backend", None),
                            **dict(getattr(actor, "weightsync_options", None) or {}))
        engine.who = describe_actor(actor)
        actor._checkpoint_engine = engine
    return engine


def _check_peft(actor: Any, peft_config: Any) -> list[str]:
    names = getattr(actor, "get_model_param_names", None)
    return peft_config_problems(peft_config, list(names())) if callable(names) else []


def _before_send(actor: Any, adapter_only: bool) -> None:
    engine = actor._get_or_create_checkpoint_engine()
    layout, error = None, None
    describe = getattr(actor, "weightsync_describe_weights", None)
    if engine.sends and callable(describe):
        try:
            layout = describe(bool(adapter_only))
        except Exception as exc:  # refused for everybody by rank 0, not a hang
            error = f"trainer rank {engine.tindex or 0}: describing its weights failed: " \
                    f"{type(exc).__name__}: {exc}"
    engine.expect(adapter_only=bool(adapter_only), error=error, layout=layout)


def _check_key(adapter: bool, peft_config: Any) -> str:
    return json.dumps(["adapter", peft_config] if adapter else ["full"], sort_keys=True,
                      default=str)


def _before_receive(actor: Any, base_sync_done: bool, peft_config: Any) -> WeightsyncSwiftEngine:
    engine = actor._get_or_create_checkpoint_engine()
    adapter = peft_config is not None and bool(base_sync_done)   # as VllmServer decides
    check = getattr(actor, "weightsync_check_peft_config", None)
    key = _check_key(adapter, peft_config)
    try:   # a config that fitted this engine's model fits it again (one model per engine)
        problems = check(peft_config) if adapter and check is not None and \
            key not in engine.peft_fits else []
    except Exception as exc:  # a failing check is an objection too, not a crash mid-sync
        problems = [f"checking the peft config failed: {type(exc).__name__}: {exc}"]
    if adapter and not problems:
        engine.peft_fits.add(key)
    checker = getattr(actor, "weightsync_check_weights", None)
    if not callable(checker):
        checker = functools.partial(default_check_weights, actor)
    engine.expect(adapter_only=adapter, error="; ".join(problems) or None,
                  check=lambda offered: checker(offered, adapter, peft_config if adapter else None),
                  key=key)
    return engine


def _receive_call(actor: Any, orig: Any, base_sync_done: bool, peft_config: Any) -> Any:
    """A rollout's ``receive_checkpoint_weights``: the intent, the report sent at once (it
    travels while ``orig`` gets the server ready to load), then ``orig``."""
    engine = _before_receive(actor, base_sync_done, peft_config)
    call = engine.begin_receive()
    failed: Optional[BaseException] = None
    try:
        return orig(base_sync_done=base_sync_done, peft_config=peft_config)
    except BaseException as exc:
        failed = exc
        engine.note_failed()
        raise
    finally:
        engine.end_receive(call, failed)   # a call that failed before it read tells the group


class WeightsyncCheckpointMixin(SwiftMixin):
    """ms-swift's ``CheckpointEngineMixin`` whose engine is weightsync's. Put it before the
    ms-swift actor class (``MegatronWorker``, ``VllmServer``) in the bases so that its
    ``send_checkpoint_weights`` / ``receive_checkpoint_weights`` wrappers run first."""

    weightsync_backend: Optional[str] = None
    weightsync_options: Optional[dict] = None

    def _get_or_create_checkpoint_engine(self) -> WeightsyncSwiftEngine:
        return engine_of(self)

    def configure_weightsync(self, backend: Optional[str] = None, **options: Any) -> None:
        """Use another backend / options from the next sync on (the old engine is closed)."""
        engine = self.__dict__.get("_checkpoint_engine")
        if isinstance(engine, WeightsyncSwiftEngine):
            engine.close()
        self._checkpoint_engine = None
        self.weightsync_backend, self.weightsync_options = backend, dict(options)

    def weightsync_stats(self) -> dict:
        engine = engine_of(self)
        return dict(engine.stats, rank=engine.rank, version=engine.version,
                    backend=engine.backend, has_base=engine.has_base)

    def weightsync_check_peft_config(self, peft_config: Any) -> list[str]:
        """Problems of loading an adapter with this config (default: against
        ``get_model_param_names()``, which ms-swift's ``VllmServer`` has)."""
        return _check_peft(self, peft_config)

    def weightsync_describe_weights(self, adapter_only: bool) -> Optional[list]:
        """Trainer actors: ``[[name, shape, dtype], ...]`` of what ``send_checkpoint_weights
        (adapter_only)`` will yield on this rank, from metadata only, or None (default: not
        known; the sync is then checked against what this rank's last complete send of this
        weight set yielded).
        Override where the model can tell without exporting."""
        return None

    def weightsync_check_weights(self, offered: list, adapter_only: bool,
                                 peft_config: Optional[dict]) -> Optional[list]:
        """Rollout actors: problems (``[[name, why], ...]``) of loading ``offered``
        (``[[name, shape, dtype], ...]``), or None when this actor cannot check (default:
        :func:`~weightsync.integrations.swift.layout.default_check_weights`)."""
        return default_check_weights(self, offered, adapter_only, peft_config)

    def send_checkpoint_weights(self, adapter_only: bool = False) -> Any:
        _before_send(self, adapter_only)
        return super().send_checkpoint_weights(adapter_only=adapter_only)

    def receive_checkpoint_weights(self, base_sync_done: bool = False,
                                   peft_config: Optional[dict] = None) -> Any:
        return _receive_call(self, super().receive_checkpoint_weights, base_sync_done,
                             peft_config)


def _wrap_send(orig: Any) -> Any:
    @functools.wraps(orig)
    def send_checkpoint_weights(self: Any, adapter_only: bool = False) -> Any:
        _before_send(self, adapter_only)
        return orig(self, adapter_only=adapter_only)
    return send_checkpoint_weights


def _wrap_receive(orig: Any) -> Any:
    @functools.wraps(orig)
    def receive_checkpoint_weights(self: Any, base_sync_done: bool = False,
                                   peft_config: Optional[dict] = None) -> Any:
        return _receive_call(self, functools.partial(orig, self), base_sync_done, peft_config)
    return receive_checkpoint_weights


_SAVED: dict = {}
_ACTORS = (("swift.ray.megatron.megatron_worker", "MegatronWorker", "send_checkpoint_weights",
            _wrap_send),
           ("swift.ray.megatron.rollout.vllm_server", "VllmServer", "receive_checkpoint_weights",
            _wrap_receive))


def install() -> None:
    """Give every ms-swift actor in this process weightsync's engine: patches
    ``CheckpointEngineMixin._get_or_create_checkpoint_engine`` and wraps
    ``MegatronWorker.send_checkpoint_weights`` / ``VllmServer.receive_checkpoint_weights``
    where their modules import. For Ray's ``worker_process_setup_hook`` (no arguments: the
    backend comes from ``WEIGHTSYNC_SWIFT_BACKEND``). Idempotent; :func:`uninstall` undoes it."""
    if _SAVED:
        return
    _SAVED[(SwiftMixin, "_get_or_create_checkpoint_engine")] = \
        SwiftMixin.__dict__["_get_or_create_checkpoint_engine"]
    SwiftMixin._get_or_create_checkpoint_engine = engine_of
    for module, name, method, wrap in _ACTORS:
        try:
            cls = getattr(importlib.import_module(module), name)
        except Exception as exc:  # noqa: BLE001 - e.g. Megatron is not installed here
            logger.info("weightsync-swift: %s.%s not wrapped (%s: %s)", module, name,
                        type(exc).__name__, exc)
            continue
        orig = cls.__dict__.get(method)
        if orig is None:
            logger.info("weightsync-swift: %s has no %s of its own; not wrapped", name, method)
            continue
        _SAVED[(cls, method)] = orig
        setattr(cls, method, wrap(orig))
        if "weightsync_check_peft_config" not in cls.__dict__:
            _SAVED[(cls, "weightsync_check_peft_config")] = None
            cls.weightsync_check_peft_config = _check_peft
        if method == "receive_checkpoint_weights" and "weightsync_check_weights" not in \
                cls.__dict__:
            _SAVED[(cls, "weightsync_check_weights")] = None
            cls.weightsync_check_weights = default_check_weights


def uninstall() -> None:
    """Undo :func:`install` (engines already created stay as they are)."""
    for (cls, attr), value in _SAVED.items():
        if value is None:
            delattr(cls, attr)
        else:
            setattr(cls, attr, value)
    _SAVED.clear()


def installed() -> bool:
    return bool(_SAVED)
