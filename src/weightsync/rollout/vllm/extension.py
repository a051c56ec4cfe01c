"""The worker extension that hosts a receiving checkpoint engine inside each vLLM worker.

Pass ``worker_extension_cls="weightsync.rollout.vllm.extension.WeightSyncWorkerExtension"`` to
``vllm.LLM`` (:class:`~weightsync.rollout.vllm.VLLMRolloutReplica` does). vLLM mixes this
class into its worker class, so the methods below run in the worker process with
``self`` being the vLLM worker; the driver calls them with ``collective_rpc(name,
args=...)``. Arguments and results are JSON-able (names, versions, options, metas,
stats): weight bytes never travel through the RPC; they go from the transport straight
into vLLM's loader (:mod:`weightsync.rollout.vllm.apply`).

Every call returns ``{"ok": True, "value": ...}`` or ``{"ok": False, "error": {...}}``
(type, message, peer, phase, version), which the driver turns back into the matching
:class:`~weightsync.core.errors.WeightSyncError`; a failure never kills the engine core.

Apply modes of a sync (``apply``): ``"stream"`` feeds tensors to the loader as they
arrive (peak memory: the model plus the layers in flight); a failure half way leaves
some layers new and some old: the worker zeroes its KV cache and reports its model
*torn* (``weightsync_state()["fenced"]``), and the driver, which alone decides whether
the replica generates (its :class:`~weightsync.rollout.protocol.SyncFence`), refuses
generation until a complete version lands. ``"staged"`` receives and checks the whole
version first, then loads it: a transport failure leaves the old version intact and
serving, at the cost of one extra copy of the weights in memory.

Called only by the driver (:mod:`weightsync.rollout.vllm.driver` and
:mod:`weightsync.rollout.vllm.replica`), through ``collective_rpc``.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time
from typing import Any, Callable, Optional

__all__ = ["WeightSyncWorkerExtension"]

logger = logging.getLogger(__name__)
_APPLY = ("stream", "staged")


class _State:
    def __init__(self) -> None:
        from weightsync.core.aio import AsyncRunner

        self.engine: Any = None
        self.runner = AsyncRunner("weightsync-vllm-worker")
        self.version: Any = None
        # A mirror, not an authority: why this worker's model holds no complete version
        # (set when a load starts writing it, cleared when one completes). Only the
        # driver's SyncFence decides whether the replica generates; after a failed
        # receive it reads this (``weightsync_state``) to tell a torn model from intact
        # old weights, and tears its fence with this reason.
        self.torn: Optional[str] = None
        self.manifest: Any = False      # False: not read yet; None: no manifest
        self.header: Optional[dict] = None  # {name: (shape, safetensors dtype)}
        self.digests: Optional[dict] = None  # of the last complete version (see .checks)
        self.dtypes: dict = {}
        self.live: list = []            # names whose live parameters are hashed at verify
        self.slices: Optional[bool] = None  # whether the engine pulls only kept slices


def _error(exc: BaseException) -> dict:
    from weightsync.core.errors import WeightSyncError

    err = {"type": type(exc).__name__, "message": str(exc)[:4000]}
    if isinstance(exc, WeightSyncError):
        err.update(message=exc.detail[:4000], peer=exc.peer, phase=exc.phase, origin=exc.origin,
                   version=exc.version if exc.version is None or
                   isinstance(exc.version, (int, str)) else str(exc.version))
    return err


def _guard(fn: Callable) -> Callable:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> dict:
        try:
            return {"ok": True, "value": fn(self, *args, **kwargs)}
        except Exception as exc:  # the driver re-raises it; the engine core lives on
            logger.warning("weightsync: %s failed in vLLM worker %s: %s", fn.__name__,
                           getattr(self, "rank", "?"), exc)
            return {"ok": False, "error": _error(exc)}
    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


class WeightSyncWorkerExtension:
    """Methods mixed into vLLM's worker (names start with ``weightsync_``, which no vLLM
    worker attribute does: vLLM refuses extensions that shadow worker attributes)."""

    def _weightsync(self) -> _State:
        state = self.__dict__.get("_weightsync_state")
        if state is None:
            state = self.__dict__["_weightsync_state"] = _State()
        return state

    def _weightsync_manifest(self, state: _State) -> Optional[dict]:
        if state.manifest is False:
            from weightsync.rollout.vllm.apply import checkpoint_header

            state.header = checkpoint_header(self.model_config.model)
            state.manifest = None if state.header is None else {
                n: shape for n, (shape, _) in state.header.items()}
        return state.manifest

    def _weightsync_peer(self) -> str:
        return f"vllm worker {getattr(self, 'rank', 0)} (pid {os.getpid()})"

    # -- engine lifecycle ---------------------------------------------------------------
    @_guard
    def weightsync_prepare(self, backend: str, engine_kwargs: dict) -> dict:
        """Create the receiving engine here; returns its ``prepare()`` meta."""
        from weightsync.transport.registry import CheckpointEngineRegistry

        state = self._weightsync()
        if state.engine is not None:
            state.engine.finalize()
            state.engine = None
        kwargs = dict(engine_kwargs)
        kwargs.setdefault("device", str(self.device))
        state.engine = CheckpointEngineRegistry.new(backend, role="rollout", **kwargs)
        state.slices = None
        return state.engine.prepare()

    @_guard
    def weightsync_init(self, kwargs_list: list) -> None:
        """Join the group with this worker's entry (``kwargs_list[rank]``)."""
        state = self._weightsync()
        if state.engine is None:
            raise RuntimeError("weightsync_init before weightsync_prepare")
        rank = int(getattr(self, "rank", 0))
        if not isinstance(kwargs_list, list) or not 0 <= rank < len(kwargs_list):
            raise ValueError(f"init needs one kwargs entry per vLLM worker; worker {rank} "
                             f"got {kwargs_list!r:.200}")
        state.engine.init_process_group(**kwargs_list[rank])

    @_guard
    def weightsync_finalize(self) -> None:
        state = self._weightsync()
        if state.engine is not None:
            state.engine.finalize()
            state.engine = None

    @_guard
    def weightsync_execute(self, method: str, args: list, kwargs: dict) -> Any:
        """``execute_checkpoint_engine``: a public method of the hosted engine."""
        from weightsync.rollout.protocol import execute_on_engine

        state = self._weightsync()
        if state.engine is None:
            raise RuntimeError("no checkpoint engine in this vLLM worker (prepare first)")
        return execute_on_engine(state.engine, method, args, kwargs, state.runner)

    @_guard
    def weightsync_state(self) -> dict:
        """Identity and state; the first call also reads the checkpoint's manifest (the
        names and shapes every full sync must cover), so the folder may go afterwards."""
        state = self._weightsync()
        self._weightsync_manifest(state)
        return {"version": state.version, "fenced": state.torn, "pid": os.getpid(),
                "rank": int(getattr(self, "rank", 0)), "engine": state.engine is not None,
                "manifest": None if state.manifest is None else len(state.manifest)}

    @_guard
    def weightsync_transfer_state(self) -> dict:
        """The state of this worker's vLLM weight-transfer backend when it is weightsync's
        (``weight_transfer_config`` ``weightsync-<backend>``, the ``vllm serve`` path of
        :class:`~weightsync.rollout.vllm.server_replica.VLLMServerReplica`): its
        ``report()`` (version, torn, an update open, digests of the last complete version),
        plus this worker's pid and what a client of the server must know of the engine
        (``config``: model, dtype, vocabulary size, max_model_len, sleep mode, logprobs
        mode, the weight-transfer backend, the LoRA rank limit or None)."""
        engine = getattr(self, "weight_transfer_engine", None)
        report = getattr(engine, "report", None)
        if not callable(report):
            raise RuntimeError("this vLLM was not started with a weightsync weight-transfer "
                               "backend (--weight-transfer-config '{\"backend\": "
                               "\"weightsync-shm\"}'), so it has no weightsync transfer state")
        out = dict(report())
        mc = self.model_config
        lora = self.vllm_config.lora_config
        out.update(pid=os.getpid(), config={
            "model": str(mc.model), "dtype": str(mc.dtype).replace("torch.", ""),
            "vocab_size": int(mc.get_vocab_size()), "max_model_len": int(mc.max_model_len),
            "enable_sleep_mode": bool(mc.enable_sleep_mode),
            "logprobs_mode": str(mc.logprobs_mode), "max_logprobs": int(mc.max_logprobs),
            "backend": str(self.vllm_config.weight_transfer_config.backend),
            "max_lora_rank": None if lora is None else int(lora.max_lora_rank)})
        return out

    @_guard
    def weightsync_zero_kv_cache(self) -> int:
        from weightsync.rollout.vllm.apply import zero_kv_cache

        return zero_kv_cache(self)

    # -- checks (see .checks) ---------------------------------------------------------------
    @_guard
    def weightsync_check(self, offered: list, kind: str) -> Optional[list]:
        """Problems (``[name, why]``) of loading ``offered`` as ``kind``; nothing changes.
        ``[]`` when the model was not started from a local safetensors folder."""
        from weightsync.rollout.vllm.checks import check_offered

        state = self._weightsync()
        if self._weightsync_manifest(state) is None:
            logger.warning("weightsync: no checkpoint headers to check a weight set against")
            return []
        lora = self.vllm_config.lora_config
        return check_offered(state.header, offered, kind, self.model_config.dtype,
                             None if lora is None else int(lora.max_lora_rank))

    @_guard
    def weightsync_digests(self) -> dict:
        """Digests of the last complete version as the loader received it, and of the live
        parameters that can be read back exactly (``live``)."""
        from weightsync.rollout.vllm.checks import live_digests
        from weightsync.core.errors import WeightSyncError

        state = self._weightsync()
        if state.digests is None:
            raise WeightSyncError("no digests: no sync completed in this vLLM worker since "
                                  "it started or since the last failed one (or "
                                  "WEIGHTSYNC_VLLM_DIGESTS=0)", peer=self._weightsync_peer(),
                                  phase="verify", version=state.version)
        live = live_digests(self.model_runner.get_model(), state.live, state.manifest,
                            state.dtypes)
        return {"version": state.version, "digests": state.digests, "dtypes": state.dtypes,
                "live": live}

    # -- a sync -------------------------------------------------------------------------
    @_guard
    def weightsync_receive(self, version: Any, kind: str, options: dict) -> dict:
        """Receive one version from the hosted engine and apply it completely or fence.

        ``options``: ``apply`` (``"stream"``/``"staged"``), ``loader``
        (``"auto"``/``"layerwise"``/``"direct"``), ``slices`` (``"auto"``: with tensor
        parallelism and an engine that can, pull only what this worker's loaders read, as
        recorded by :func:`~weightsync.rollout.vllm.slices.record_slices`; ``"on"``,
        ``"off"``), for ``kind="adapter"``: ``adapter_name`` and ``adapter_config`` (the
        adapter is held in memory, see :meth:`_weightsync_adapter`).
        """
        from weightsync.core.errors import PlanMismatch

        state = self._weightsync()
        if state.engine is None:
            raise RuntimeError("weightsync_receive before weightsync_init")
        apply = options.get("apply", "stream")
        if apply not in _APPLY:
            raise ValueError(f"apply must be one of {_APPLY}, got {apply!r}")
        if kind not in ("full", "base", "adapter"):
            raise ValueError(f"kind must be 'full', 'base' or 'adapter', got {kind!r}")
        start = time.perf_counter()
        self._weightsync_slices(state, kind, options.get("slices", "auto"))
        pull = _Pull(state, version, self._weightsync_peer())
        try:
            if options.get("reject"):         # refuse, but through the stream: the
                next(pull, None)              # senders learn it at once, not at timeout
                raise PlanMismatch(str(options["reject"]), peer=self._weightsync_peer(),
                                   phase="receive", version=version)
            if kind == "adapter":
                stats = self._weightsync_adapter(pull, version, options)
            else:
                stats = self._weightsync_full(state, pull, version, apply,
                                              options.get("loader", "auto"),
                                              bool(options.get("digests", True)))
        except BaseException as exc:
            pull.close(exc)
            raise
        pull.close(None)
        plan = getattr(state.engine, "last_plan", None)
        if plan is not None:             # point-to-point: what this worker pulled
            stats["pulled_bytes"] = int(plan.total_bytes)
        stats.update(version=version, kind=kind, apply=apply, pid=os.getpid(),
                     seconds=time.perf_counter() - start, sliced=bool(state.slices))
        stats["load_seconds"] = max(0.0, stats["seconds"] - stats["transport_seconds"])
        return stats

    def _weightsync_slices(self, state: _State, kind: str, mode: str) -> None:
        """Tell the engine what this worker keeps (full and base syncs), or everything."""
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"slices must be 'auto', 'on' or 'off', got {mode!r}")
        able = "slices" in getattr(state.engine, "capabilities", ())
        if mode == "on" and not able:
            raise ValueError(f"slices='on' needs an engine that pulls slices (nixl); this "
                             f"one is {type(state.engine).__name__}")
        tp = int(self.vllm_config.parallel_config.tensor_parallel_size)
        want = able and kind != "adapter" and (mode == "on" or (mode == "auto" and tp > 1))
        if want == bool(state.slices) and state.slices is not None:
            return
        if able:
            if want:
                from weightsync.rollout.vllm.slices import record_slices

                state.engine.keep_slices(functools.partial(record_slices, self))
            else:
                state.engine.keep_slices(None)
        state.slices = want

    def _weightsync_full(self, state: _State, pull: "_Pull", version: Any, apply: str,
                         loader: str, digests: bool) -> dict:
        from weightsync.rollout.vllm.apply import (CheckedStream, apply_weights, heal_after_failure,
                                  pick_loader, zero_kv_cache)
        from weightsync.rollout.vllm.checks import calibrate_live
        from weightsync.core.errors import PlanMismatch

        self._weightsync_manifest(state)
        loader = pick_loader(loader)
        peer = self._weightsync_peer()
        checked = CheckedStream(pull, state.manifest, version=version, peer=peer,
                                digest_dtype=self.model_config.dtype if digests else None)
        items: Any = checked
        if state.slices:
            checked.prefetch()                # the slices are recorded before the session
        if apply == "staged":
            staged = collections.deque(checked)   # the whole version, owned and checked
            missing = checked.missing()
            if missing:
                raise PlanMismatch(f"the sync left {len(missing)} tensors of the model "
                                   f"unwritten: {missing[:8]}", peer=peer, phase="receive",
                                   version=version)
            items = _drain(staged)            # each tensor freed once its layer is loaded
        state.torn = f"the sync of version {version!r} did not complete"
        state.digests, state.dtypes, state.live = None, {}, []
        try:
            info = apply_weights(self, items, loader=loader, version=version, peer=peer)
        except BaseException:
            if loader == "layerwise":
                heal_after_failure(self)
            zero_kv_cache(self)
            raise
        state.version, state.torn = version, None
        if digests:
            state.digests, state.dtypes = checked.digests, checked.dtypes
            state.live = calibrate_live(self.model_runner.get_model(), checked.digests,
                                        state.manifest, checked.dtypes)
        return {"tensors": checked.count, "bytes": checked.nbytes, "loader": loader,
                "kept_in_part": checked.partial,
                "transport_seconds": checked.transport_seconds, **info}

    def _weightsync_adapter(self, pull: "_Pull", version: Any, options: dict) -> dict:
        """Receive the whole adapter, then hold it in this worker's memory
        (:func:`weightsync.rollout.vllm.lora.register`); the driver loads it through
        vLLM's ``add_lora`` with the returned ``adapter_path``. No file is written."""
        from weightsync.rollout.vllm import lora

        name, config = options.get("adapter_name"), options.get("adapter_config")
        if not isinstance(name, str) or not isinstance(config, dict):
            raise ValueError("an adapter sync needs options adapter_name (str) and "
                             "adapter_config (PEFT's JSON)")
        lora.install()
        tensors, nbytes, start = {}, 0, time.perf_counter()
        for tname, t in pull:
            tensors[tname] = t.clone()
            nbytes += t.numel() * t.element_size()
        transport = time.perf_counter() - start
        keep = max(lora.KEEP, 2 * int(getattr(self.vllm_config.lora_config, "max_cpu_loras",
                                              0) or 0))
        path = lora.register(name, version, tensors, config, keep=keep)
        return {"tensors": len(tensors), "bytes": nbytes, "transport_seconds": transport,
                "adapter_path": path}

    @_guard
    def weightsync_adapter_digests(self, path: str) -> dict:
        """Digests of the adapter this worker holds in memory under ``path``."""
        from weightsync.rollout.vllm import lora

        return lora.adapter_digests(path)


def _drain(queue: "collections.deque") -> Any:
    while queue:
        yield queue.popleft()


class _Pull:
    """Sync iterator over the hosted engine's async ``receive_weights`` stream."""

    _END = object()

    def __init__(self, state: _State, version: Any, peer: str) -> None:
        self.state, self.version, self.peer = state, version, peer
        self.stream = state.engine.receive_weights(version)
        self.timeout = 2 * state.engine.config.timeout + 30
        self.started = False

    def __iter__(self) -> "_Pull":
        return self

    def __next__(self) -> Any:
        self.started = True

        async def step() -> Any:
            try:
                return await self.stream.__anext__()
            except StopAsyncIteration:
                return self._END

        item = self.state.runner.run(step(), timeout=self.timeout, phase="receive",
                                     version=self.version, peer=self.peer)
        if item is self._END:
            raise StopIteration
        return item

    def close(self, exc: Optional[BaseException]) -> None:
        """End the stream; on a failure this tells the senders at once, with its text (a
        stream never read: through the engine's ``abort_receive``)."""
        from weightsync.core.errors import WeightSyncError

        if not self.started:
            self.started = True
            try:
                self.state.engine.abort_receive(exc if exc is not None else WeightSyncError(
                    "the worker ended the sync before it read the weights", peer=self.peer,
                    phase="receive", version=self.version), self.version)
            except Exception:
                if exc is None:
                    raise
            return

        async def close() -> None:
            if isinstance(exc, Exception):
                try:
                    await self.stream.athrow(exc)    # the engine reports it to its peers
                except BaseException:  # noqa: BLE001 - that very error, raised by the caller
                    pass
            await self.stream.aclose()

        try:
            self.state.runner.run(close(), timeout=30.0, phase="receive",
                                  version=self.version, peer=self.peer)
        except Exception:
            if exc is None:
                raise
            logger.debug("weightsync: closing the receive stream failed", exc_info=True)
