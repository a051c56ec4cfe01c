"""Mixins that give a trainer or rollout worker (a Ray actor class or a plain object) the
calls :class:`~weightsync.orchestration.manager.CheckpointEngineManager` makes.

Trainer workers: subclass :class:`TrainerWorkerMixin` and implement
``weightsync_model()`` (the model, plain, FSDP2 or PEFT); optionally
``weightsync_group()`` (the process group that shares the export, default: the world),
``weightsync_offload()`` / ``weightsync_reload()`` (colocated mode).

Rollout workers: subclass :class:`RolloutWorkerMixin` and set ``self.rollout`` to a
rollout adapter (:class:`~weightsync.rollout.protocol.RolloutAdapter`), or override
``weightsync_rollout()``.

Both expose ``execute_checkpoint_engine(method, *args, **kwargs)`` to reach the hosted
engine directly (:func:`weightsync.rollout.protocol.execute_on_engine`, as the rollout
adapters do). Every call is synchronous and bounded by the engine's timeout.

Mixed into the workers of :mod:`weightsync.integrations.ray` (``workers``,
``vllm_workers``) and users' own classes. The calls themselves (their names, arguments and
what each does) are the protocols :class:`~weightsync.orchestration.workers.TrainerWorker`
and :class:`~weightsync.orchestration.workers.RolloutWorker`, which these mixins implement.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

from weightsync.core.aio import AsyncRunner
from weightsync.transport.registry import CheckpointEngineRegistry
from weightsync.transport.codec import carry_codec_state
from weightsync.trainer.digests import describe_export, export_digests
from weightsync.core.plan import dtype_from_name
from weightsync.trainer.export import KINDS, export_weights
from weightsync.trainer.lora import is_peft_model, lora_config_dict
from weightsync.rollout.protocol import execute_on_engine
from weightsync.orchestration import workers as ws

__all__ = ["TrainerWorkerMixin", "RolloutWorkerMixin"]

logger = logging.getLogger(__name__)


class _TrainerSide:
    def __init__(self) -> None:
        self.engine: Any = None
        self.runner = AsyncRunner("weightsync-trainer")
        self.last_kind: Optional[str] = None


class TrainerWorkerMixin:
    """Sending side of weightsync for one trainer rank: implements
    :class:`~weightsync.orchestration.workers.TrainerWorker`."""

    # -- hooks for the user's class ------------------------------------------------------
    def weightsync_model(self) -> Any:
        raise NotImplementedError("implement weightsync_model() to return the trainer model")

    def weightsync_group(self) -> Any:
        return None

    def weightsync_offload(self) -> None:
        """Free training state (optimizer, gradients) before the rollout wakes (colocated)."""

    def weightsync_reload(self) -> None:
        """Bring back what ``weightsync_offload`` freed."""

    # -- calls made by the manager -------------------------------------------------------
    def _ws(self) -> _TrainerSide:
        side = self.__dict__.get("_weightsync_trainer")
        if side is None:
            side = self.__dict__["_weightsync_trainer"] = _TrainerSide()
        return side

    def ws_prepare(self, backend: str, engine_kwargs: dict) -> dict:
        side = self._ws()
        old = side.engine
        if old is not None:
            old.finalize()
        side.engine = CheckpointEngineRegistry.new(backend, role="trainer", **engine_kwargs)
        carry_codec_state(old, side.engine)     # delta bases outlive a rebuilt group
        side.last_kind = None
        return side.engine.prepare()

    def ws_init(self, kwargs: dict) -> None:
        self._engine_or_raise().init_process_group(**kwargs)

    def ws_send(self, version: Any, *, kind: str = "full") -> dict:
        """Export ``kind`` of the model and send it as ``version``; returns the metrics."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        side, engine = self._ws(), self._engine_or_raise()
        if side.last_kind != kind:      # another weight set: owners and layouts change
            engine.reset_plan()
            side.last_kind = kind
        items = export_weights(self.weightsync_model(), kind=kind, dtype=engine.config.dtype,
                               group=self.weightsync_group(),
                               shards="shards" in type(engine).capabilities)
        start = time.perf_counter()
        try:
            metrics = side.runner.run(engine.send_weights(items, version=version),
                                      timeout=2 * engine.config.timeout + 30, phase="send",
                                      version=version)
        except BaseException:
            _drain(items)
            raise
        metrics = dict(metrics)
        metrics["wall_seconds"] = time.perf_counter() - start
        return metrics

    def ws_describe(self, kind: str = "full", dtype: Optional[str] = None) -> list:
        """``[[name, shape, dtype], ...]`` of what ``ws_send(kind)`` would send (no bytes
        move: metadata of the model, full shapes of FSDP2 shards, after the cast to
        ``dtype``, a dtype name; default: the engine's)."""
        return describe_export(self.weightsync_model(), kind, self._export_dtype(dtype))

    def ws_digest(self, kind: str = "full", cast_to: Optional[dict] = None,
                  dtype: Optional[str] = None, quantize: Optional[str] = None,
                  quantize_skip: Optional[list] = None) -> dict:
        """Digests of the tensors this rank exports (every rank must call it; see
        :func:`weightsync.trainer.digests.export_digests`); ``quantize``: as the codec's
        FP8 quantizer turns them into weights and scales."""
        return export_digests(self.weightsync_model(), kind=kind,
                              dtype=self._export_dtype(dtype),
                              group=self.weightsync_group(), cast_to=cast_to,
                              quantize=quantize, quantize_skip=quantize_skip)

    def _export_dtype(self, dtype: Optional[str]) -> Any:
        if dtype is not None:
            return dtype_from_name(dtype)
        engine = self._ws().engine
        return engine.config.dtype if engine is not None else None

    def ws_finalize(self) -> None:
        side = self._ws()
        if side.engine is not None:
            side.engine.finalize()
            side.engine = None

    def ws_lora_config(self) -> Optional[dict]:
        """The active adapter's PEFT config (JSON-able), or None for a model without LoRA."""
        model = self.weightsync_model()
        return lora_config_dict(model) if is_peft_model(model) else None

    def ws_offload(self) -> None:
        self.weightsync_offload()

    def ws_reload(self) -> None:
        self.weightsync_reload()

    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return execute_on_engine(self._engine_or_raise(), method, args, kwargs,
                                 self._ws().runner)

    def _engine_or_raise(self) -> Any:
        engine = self._ws().engine
        if engine is None:
            raise RuntimeError(f"no checkpoint engine on this trainer worker; {ws.PREPARE} first")
        return engine


def _drain(items: Any, timeout: float = 600.0) -> None:
    """Run a failed send's export to its end: its FSDP2 exchanges are collectives, and the
    other trainer ranks finish theirs (sending or draining) only if this rank takes part.
    A send that timed out may still be inside the generator (``ValueError: generator
    already executing``): wait for it to leave (it stops iterating once cancelled), then
    go on from there; at most ``timeout`` in all."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            for _ in items:
                pass
            return
        except ValueError as exc:
            if not getattr(items, "gi_running", False):   # the export's own error
                logger.warning("weightsync: draining the export after a failed send: %r", exc)
                return
            if time.monotonic() > deadline:
                logger.warning("weightsync: the failed send never left the export; the "
                               "other trainer ranks' export collectives may hang")
                return
            time.sleep(0.01)
        except Exception as exc:   # the export group itself broke: nothing left to keep aligned
            logger.warning("weightsync: draining the export after a failed send: %r", exc)
            return


class RolloutWorkerMixin:
    """Receiving side of weightsync for one rollout replica (delegates to its adapter):
    implements :class:`~weightsync.orchestration.workers.RolloutWorker`."""

    def weightsync_rollout(self) -> Any:
        rollout = getattr(self, "rollout", None)
        if rollout is None:
            raise RuntimeError("set self.rollout to a rollout adapter (or override "
                               "weightsync_rollout())")
        return rollout

    def ws_prepare(self, backend: str, engine_kwargs: dict) -> list:
        return self.weightsync_rollout().engine_prepare(backend, engine_kwargs)

    def ws_init(self, kwargs_list: list) -> None:
        self.weightsync_rollout().engine_init(kwargs_list)

    def ws_receive(self, version: Any, *, kind: str = "full",
                   adapter_config: Optional[dict] = None) -> dict:
        return self.weightsync_rollout().engine_receive(version, kind=kind,
                                                        adapter_config=adapter_config)

    def ws_finalize(self) -> None:
        self.weightsync_rollout().engine_finalize()

    def ws_pause(self, abort: bool = True) -> None:
        self.weightsync_rollout().pause(abort=abort)

    def ws_resume(self) -> None:
        self.weightsync_rollout().resume()

    def ws_sleep(self, level: int = 1) -> None:
        self.weightsync_rollout().sleep(level)

    def ws_wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        self.weightsync_rollout().wake_up(tags)

    def ws_reset_caches(self) -> None:
        self.weightsync_rollout().reset_caches()

    def ws_version(self) -> Any:
        return self.weightsync_rollout().current_version()

    def ws_begin_sync(self, version: Any, kinds: list, staged: bool = False) -> bool:
        """Fence until ``version`` is applied; ``staged`` (atomic syncs): receive it into a
        staging copy instead, committed by ``ws_commit``."""
        fn = getattr(self.weightsync_rollout(), "begin_sync", None)
        if staged:
            self._staged_call("begin_sync")(version, kinds, staged=True)
            return True
        if fn is None:
            return False
        fn(version, kinds)
        return True

    def ws_commit(self, version: Any) -> dict:
        """Atomic syncs: swap the staged copy of ``version`` in (the old one is kept)."""
        return self._staged_call("commit_sync")(version)

    def ws_abort(self, version: Any) -> dict:
        """Atomic syncs: back to the version held before the sync; what it serves now."""
        rollout = self.weightsync_rollout()
        fn = getattr(rollout, "abort_sync", None)
        if fn is None:
            return {"version": rollout.current_version(), "rolled_back": False, "busy": False}
        return fn(version)

    def ws_release(self, version: Any) -> dict:
        """Atomic syncs: ``version`` is committed everywhere; free the old copy."""
        return self._staged_call("release_sync")(version)

    def _staged_call(self, name: str) -> Any:
        rollout = self.weightsync_rollout()
        if not callable(getattr(rollout, "commit_sync", None)):
            raise NotImplementedError(f"{type(rollout).__name__} cannot stage a sync "
                                      "(no commit_sync)")
        return getattr(rollout, name)

    def ws_check_weights(self, offered: list, kind: str = "full",
                         adapter_config: Optional[dict] = None) -> Optional[list]:
        """Problems of loading ``offered`` as ``kind`` (None: the adapter cannot check)."""
        fn = getattr(self.weightsync_rollout(), "check_weights", None)
        return None if fn is None else fn(offered, kind=kind, adapter_config=adapter_config)

    def ws_digest(self, kind: str = "full") -> dict:
        rollout = self.weightsync_rollout()
        if not hasattr(rollout, "weight_digests"):
            raise NotImplementedError(f"{type(rollout).__name__} has no weight_digests()")
        return rollout.weight_digests(kind)

    def ws_fence(self, reason: str) -> bool:
        """Refuse generation until a sync completes; False if the adapter cannot fence."""
        fn = getattr(self.weightsync_rollout(), "fence", None)
        if fn is None:
            return False
        fn(reason)
        return True

    def ws_sync_state(self) -> dict:
        rollout = self.weightsync_rollout()
        fn = getattr(rollout, "sync_state", None)
        return fn() if fn is not None else {"version": rollout.current_version()}

    def ws_capabilities(self) -> dict:
        """The rollout's capabilities, plus ``self_name``: the name its own errors give it
        (``peer=``), so the manager's isolation reads them as this replica's own failure."""
        rollout = self.weightsync_rollout()
        caps = dict(rollout.capabilities())
        name = getattr(rollout, "name", None)
        if isinstance(name, str) and name:
            caps.setdefault("self_name", name)
        return caps

    def ws_call_log(self) -> list:
        return self.weightsync_rollout().call_log()

    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.weightsync_rollout().execute_checkpoint_engine(method, *args, **kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs: Any) -> list:
        return self.weightsync_rollout().generate(prompts, **kwargs)
