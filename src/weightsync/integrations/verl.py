"""weightsync backends as verl checkpoint engines (tested with verl 0.9.1).

Point verl at this module and pick a backend::

    actor_rollout_ref:
      rollout:
        checkpoint_engine:
          custom_backend_module: weightsync.integrations.verl
          backend: weightsync-shm            # or weightsync-collective, weightsync-cuda-ipc
          update_weights_bucket_megabytes: 256
          engine_kwargs:
            weightsync-shm: {timeout: 300, num_slots: 2}

Importing the module registers every weightsync backend that imports in this process in
verl's ``CheckpointEngineRegistry`` as ``weightsync-<name>``. ``inproc`` is left out: in
verl's non-"naive" path the trainer ranks and the rollout workers are always different
Ray actors (processes), so an in-process hub cannot connect them.

verl's call shape is adapted here: trainer ranks are built with ``is_master`` (so role
``trainer``), rollout workers without it (role ``rollout``); ``global_steps`` is the
weight version (``None`` accepts any); ``send_weights`` returns float metrics under
``weightsync/...``. Other ``engine_kwargs`` go to the weightsync engine (``timeout``,
``num_slots``, ``dtype``, ``checksum``, ``device``, ``host``; ``host: auto`` means this
node's IP as Ray sees it), plus ``reuse`` (below).

Cheap per-update cycle (``reuse``, default true, env ``WEIGHTSYNC_VERL_REUSE``): verl
runs prepare -> build_topology -> init_process_group -> send/receive -> finalize on
every update, on the same engine instances. With ``reuse`` the engine stays joined
across ``finalize`` (buffers, shared memory, control servers and process groups are
kept), ``prepare()`` returns the same metadata while nothing changed (including the
token of the group the worker is in), and ``build_topology`` hands back that same token
only when every worker reports it and the rest of the metadata still hashes to its
prefix; ``init_process_group`` with the keyword arguments it already joined with is then
a no-op. Anything else gets a token never used before and every worker re-joins: a
replica added or removed, a worker restarted, a failed update on any rank (that rank
releases at its next ``prepare``, so it reports no group), ``close()``, or interpreter
exit. The price: the buffers stay allocated between updates (``num_slots *
bucket_size`` per trainer rank; for ``collective`` on CUDA that is GPU memory while the
rollout generates). ``reuse: false`` releases everything at every ``finalize``.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import secrets
import socket
import time
import weakref
from dataclasses import dataclass
from typing import Any, AsyncIterator, ClassVar, Optional

import torch

try:
    from verl.checkpoint_engine import CheckpointEngine as _VerlEngine
    from verl.checkpoint_engine import CheckpointEngineRegistry as _VerlRegistry
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "weightsync.integrations.verl needs verl (tested with verl==0.9.1), which is not "
        f"importable here ({type(_exc).__name__}: {_exc}). Install it without its pins: "
        "`pip install --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.2.3 "
        "omegaconf==2.4.0 codetiming==1.4.0 orjson==3.13.0` (fastapi and uvicorn are needed "
        "too), or run `make verl` in the weightsync checkout.") from _exc

from weightsync.core.config import env_value, option, parse_bool
from weightsync.transport.registry import CheckpointEngineRegistry as _WsRegistry
from weightsync.transport.codec import split_backend_name
from weightsync.core.errors import TopologyError, WeightSyncError

__all__ = ["WeightsyncVerlEngine", "VerlOptions", "WeightStream", "register_backend",
           "registered_backends", "group_token", "PREFIX"]

logger = logging.getLogger(__name__)

PREFIX = "weightsync-"
#: weightsync backends that cannot work in verl's process layout.
_SKIP = frozenset({"inproc"})
_META_KEYS = ("verl_session", "verl_group")
_live: "weakref.WeakSet[WeightsyncVerlEngine]" = weakref.WeakSet()


@dataclass(kw_only=True)
class VerlOptions:
    """Options of the verl adapter itself (the rest of ``engine_kwargs`` go to the engine).

    ``reuse``: keep buffers, shared memory, servers and groups across updates while the
    topology is unchanged (see the module docstring).
    """

    reuse: bool = option("VERL_REUSE", parse_bool, True,
                         "Keep buffers, servers and groups across updates while the topology "
                         "is unchanged.")

    def __post_init__(self) -> None:
        if not isinstance(self.reuse, bool):
            raise ValueError(f"reuse must be true or false, got {self.reuse!r}")


def _node_ip() -> str:
    """This node's IP as Ray reports it (what verl uses), else the hostname's address."""
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # Ray missing or not connected: fall back below
        logger.debug("no Ray node IP", exc_info=True)
    return socket.gethostbyname(socket.gethostname())


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def group_token(backend: str, trainers: int, rollouts: int, metadata: list) -> str:
    """The group token for this topology (a function of the metadata only).

    Its first half hashes the metadata without the workers' current groups, so the same
    token comes back only when every worker is already in it and nothing else changed;
    otherwise the second half hashes the current groups too, which makes a new token
    (trainers' metadata carries their store secrets, so tokens cannot be guessed).
    """
    base = [{k: v for k, v in m.items() if k != "verl_group"} for m in metadata]
    head = _digest([backend, trainers, rollouts, base])[:16]
    current = {m.get("verl_group") for m in metadata}
    if len(current) == 1:
        (token,) = current
        if isinstance(token, str) and token[:16] == head:
            return token
    return head + _digest([backend, trainers, rollouts, metadata])[:16]


class WeightsyncVerlEngine(_VerlEngine):
    """A verl ``CheckpointEngine`` that drives one weightsync engine (``weightsync_backend``).

    Built by verl as ``new(backend, bucket_size=..., is_master=..., **engine_kwargs)``
    (trainer ranks) or without ``is_master`` (rollout workers).
    """

    weightsync_backend: ClassVar[str] = ""
    wire_format = "named_tensors"

    def __init__(self, bucket_size: Optional[int] = None, is_master: Optional[bool] = None,
                 **engine_kwargs: Any) -> None:
        if not self.weightsync_backend:
            raise TypeError("use a registered subclass, e.g. verl backend 'weightsync-shm'")
        if "role" in engine_kwargs:
            raise ValueError("engine_kwargs must not set 'role': trainer ranks are the ones "
                             "verl builds with is_master, rollout workers the others")
        if is_master is not None and not isinstance(is_master, bool):
            raise ValueError(f"is_master must be a bool, got {is_master!r}")
        self.options = VerlOptions(**{k: engine_kwargs.pop(k) for k in ("reuse",)
                                      if k in engine_kwargs})
        if (engine_kwargs.get("host") or env_value("HOST", str, None)) == "auto":
            engine_kwargs["host"] = _node_ip()     # as a keyword or WEIGHTSYNC_HOST=auto
        self.role = "rollout" if is_master is None else "trainer"
        self.is_master = bool(is_master)
        self.engine = _WsRegistry.new(self.weightsync_backend, bucket_size=bucket_size,
                                      role=self.role, **engine_kwargs)
        self._session = secrets.token_hex(8)
        self._joined: Optional[dict[str, Any]] = None   # kwargs of the live group
        self._active = False                             # between init and finalize
        self._dirty = False                              # an update failed: release
        self._in_flight = 0                              # running send/receive calls
        self._stream: Optional[weakref.ref] = None       # the last receive_weights stream
        self._stats = {"prepare_s": 0.0, "init_s": 0.0, "finalize_s": 0.0, "reused": False,
                       "joins": 0, "reuses": 0, "releases": 0}
        _live.add(self)

    # -- verl lifecycle ------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        start = time.perf_counter()
        stream = self._stream() if self._stream is not None else None
        if stream is not None:   # the last update's stream, still held but never read
            stream._abandon()
        if self._active:   # verl finalizes every update that succeeded everywhere
            self._dirty = True
        if self._in_flight:
            logger.warning("%s%s %s: prepare() while an earlier send/receive is still "
                           "unwinding", PREFIX, self.weightsync_backend, self.role)
        if self._dirty:
            self._release("an earlier update failed")
        try:
            meta = dict(self.engine.prepare())
        except BaseException:
            self._dirty = True
            raise
        joined = self._joined
        meta.update(verl_session=self._session,
                    verl_group=joined.get("token") if joined is not None else None)
        self._stats["prepare_s"] = time.perf_counter() - start
        return meta

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        inner_cls = _WsRegistry.get(cls.weightsync_backend)
        for i, meta in enumerate(metadata):
            if not isinstance(meta, dict) or any(k not in meta for k in _META_KEYS):
                raise TopologyError(
                    f"{PREFIX}{cls.weightsync_backend}: worker {i} is not a weightsync engine "
                    "(trainer and rollout sides must use the same backend)",
                    phase="build_topology")
        plain = [{k: v for k, v in m.items() if k not in _META_KEYS} for m in metadata]
        trainer_kw, rollout_kw = inner_cls.build_topology(actor_wg_world_size,
                                                          rollout_world_size, plain)
        if "token" in trainer_kw and "token" in rollout_kw:
            token = group_token(cls.weightsync_backend, actor_wg_world_size,
                                rollout_world_size, list(metadata))
            trainer_kw["token"] = [token] * actor_wg_world_size
            rollout_kw["token"] = [token] * rollout_world_size
        return trainer_kw, rollout_kw

    def init_process_group(self, **kwargs: Any) -> None:
        start = time.perf_counter()
        reuse = (self.options.reuse and not self._dirty and self._joined is not None
                 and self._joined == kwargs)
        if reuse:
            self._stats["reuses"] += 1
        else:
            if self._joined is not None:   # the engine leaves its old group when re-joining
                self._stats["releases"] += 1
                self._joined = None
            try:
                self.engine.init_process_group(**kwargs)
            except BaseException:
                self._dirty = True
                raise
            self._joined = dict(kwargs)
            self._stats["joins"] += 1
        self._stats["reused"] = reuse
        self._active = True
        self._stats["init_s"] = time.perf_counter() - start

    async def send_weights(self, weights: Any, global_steps: Any = None) -> dict[str, float]:
        self._check_active("send_weights")
        self._in_flight += 1
        try:
            metrics = await self.engine.send_weights(weights, version=global_steps)
        except BaseException:
            self._dirty = True
            raise
        finally:
            self._in_flight -= 1
        return self._metrics(metrics)

    def receive_weights(self, global_steps: Any = None) -> "WeightStream":
        """This update's ``(name, tensor)`` stream (an async iterator), for verl's server
        adapter. One dropped or closed before it was read tells the group (see
        :class:`WeightStream`)."""
        self._check_active("receive_weights")
        stream = WeightStream(self, global_steps)
        self._stream = weakref.ref(stream)
        return stream

    def _abandoned(self, global_steps: Any) -> None:
        """The stream of this update was dropped before it was read: tell the trainer ranks
        (best effort; this update failed, the next one re-joins)."""
        self._dirty = True
        try:
            self.engine.abort_receive(WeightSyncError(
                "verl's rollout dropped the weight stream before reading it (its "
                "update_weights failed before it began)", phase="receive",
                version=global_steps), global_steps)
        except Exception:  # the engine or its peers may be gone already
            logger.debug("%s%s: could not tell the trainer ranks", PREFIX,
                         self.weightsync_backend, exc_info=True)

    async def _receive(self, global_steps: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
        inner = self.engine.receive_weights(version=global_steps)
        self._in_flight += 1
        try:
            async for item in inner:
                yield item
        except BaseException:   # also GeneratorExit: a consumer that stopped early
            self._dirty = True
            raise
        finally:
            try:
                await inner.aclose()
            finally:
                self._in_flight -= 1

    def finalize(self) -> None:
        start = time.perf_counter()
        self._active = False
        if self._dirty or not self.options.reuse:
            self._release("failed update" if self._dirty else "reuse is off")
        self._stats["finalize_s"] = time.perf_counter() - start

    # -- extras --------------------------------------------------------------------------
    def close(self) -> None:
        """Release everything now (also done at interpreter exit). Idempotent."""
        self._active = False
        self._release("close")
        _live.discard(self)

    def cycle_stats(self) -> dict[str, Any]:
        """Seconds of the last prepare / init_process_group / finalize and counters."""
        return dict(self._stats, role=self.role, active=self._active, dirty=self._dirty,
                    in_flight=self._in_flight,
                    backend=PREFIX + self.weightsync_backend)

    def _check_active(self, what: str) -> None:
        if not self._active:
            raise RuntimeError(f"{PREFIX}{self.weightsync_backend}: {what} needs "
                               "init_process_group first")

    def _release(self, reason: str) -> None:
        had_group = self._joined is not None or self._dirty
        try:
            self.engine.finalize()
        finally:
            self._joined = None
            self._dirty = False
            if had_group:
                self._stats["releases"] += 1
                logger.debug("%s%s %s: released (%s)", PREFIX, self.weightsync_backend,
                             self.role, reason)

    def _metrics(self, metrics: Any) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, value in (metrics or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and key != "version":
                out[f"weightsync/{key}"] = float(value)
        s = self._stats
        out.update({"weightsync/prepare_s": s["prepare_s"], "weightsync/init_s": s["init_s"],
                    "weightsync/prev_finalize_s": s["finalize_s"],
                    "weightsync/group_reused": float(s["reused"]),
                    "weightsync/group_joins": float(s["joins"])})
        return out


class WeightStream:
    """What :meth:`WeightsyncVerlEngine.receive_weights` returns: the engine's receive of
    one update, begun at the first item (an async iterator with ``aclose``). verl hands it
    to its server adapter, whose ``update_weights`` may fail before it reads a byte (the
    server is gone, its own sender cannot start): the stream is then dropped unread, and
    when it is collected or closed, or at the latest at the next ``prepare()`` of its
    engine (verl's next update), it makes the engine tell the trainer ranks
    (``abort_receive``), so that they and every other peer of the update end then instead
    of at their timeout."""

    def __init__(self, owner: WeightsyncVerlEngine, global_steps: Any) -> None:
        self._owner, self._steps = owner, global_steps
        self._gen: Any = None
        self._done = False          # begun, or told the group it never will be

    def __aiter__(self) -> "WeightStream":
        return self

    async def __anext__(self) -> tuple[str, torch.Tensor]:
        if self._gen is None:
            if self._done:
                raise StopAsyncIteration
            self._done = True
            self._gen = self._owner._receive(self._steps)
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        if self._gen is not None:
            await self._gen.aclose()
        else:
            self._abandon()

    def _abandon(self) -> None:
        if not self._done:
            self._done = True
            self._owner._abandoned(self._steps)

    def __del__(self) -> None:
        try:
            self._abandon()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


def _skipped(name: str) -> bool:
    return split_backend_name(name)[1] in _SKIP     # "delta+inproc" is inproc underneath


def register_backend(name: str) -> type:
    """Register weightsync backend ``name`` in verl's registry as ``weightsync-<name>``."""
    if _skipped(name):
        raise ValueError(f"weightsync backend {name!r} cannot connect verl's processes")
    _WsRegistry.get(name)  # BackendUnavailable / ValueError now, not on first use
    cls_name = "Weightsync" + "".join(p.capitalize() for p in name.replace("+", "_").split("_")) \
        + "Engine"
    cls = type(cls_name, (WeightsyncVerlEngine,), {"weightsync_backend": name,
                                                   "__module__": __name__,
                                                   "__qualname__": cls_name})
    globals()[cls_name] = cls
    _VerlRegistry.register(PREFIX + name)(cls)
    if "_" in name:  # verl's own names use dashes: weightsync-cuda-ipc
        _VerlRegistry.register(PREFIX + name.replace("_", "-"))(cls)
    return cls


def registered_backends() -> list[str]:
    """verl backend names this module registered."""
    return sorted(k for k, v in _VerlRegistry._registry.items()
                  if isinstance(v, type) and issubclass(v, WeightsyncVerlEngine))


def _close_all() -> None:
    for engine in list(_live):
        try:
            engine.close()
        except Exception:  # exiting: best effort
            logger.debug("closing a weightsync verl engine failed", exc_info=True)


atexit.register(_close_all)

for _name in _WsRegistry.names():
    if not _skipped(_name):
        register_backend(_name)
