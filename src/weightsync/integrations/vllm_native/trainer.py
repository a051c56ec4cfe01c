"""The trainer side of ``weightsync-<backend>``: a vLLM ``TrainerWeightTransferEngine``.

Built by vLLM's factory from a trainer init info (:mod:`.info`), on every trainer rank::

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource
    from weightsync.integrations.vllm_native import ShmTrainerInitInfo, OfflineLLMClient

    engine = WeightTransferTrainerFactory.trainer_init(
        ShmTrainerInitInfo(rank=0, rollout_world_size=1),
        client=OfflineLLMClient(llm),            # or HTTPWeightSyncClient(url), Ray's client
        source=ModuleSource(model))
    engine.send_weights(weight_version="step-3")  # every step
    engine.shutdown()

``trainer_init`` (rank 0) hosts weightsync's rendezvous store and joins the workers,
which the client's ``init_weight_transfer_engine`` makes join at the same time.
``send_weights`` drives one update: ``start_weight_update``; ``update_weights`` with
``phase="check"`` (the weight set's names, shapes and wire dtypes, checked by every worker
before a byte moves); ``update_weights`` with ``phase="receive"`` while this rank streams
the tensors through the weightsync engine; ``finish_weight_update(weight_version)``, which
makes ``weight_version`` vLLM's current weight version. Every wait is bounded (twice the
engine ``timeout`` plus a margin); a failure on either side raises here with its cause.
Ranks other than 0 only walk their source (it may be a collective, e.g. FSDP gathers).

``send_adapter(tensors, config, name=...)`` syncs a LoRA adapter instead (vLLM started
with ``--enable-lora``): the same check and receive, then the adapter is loaded through
vLLM's LoRA API from the workers' memory (``/v1/load_lora_adapter`` with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, or ``add_lora`` offline), and only then does
``finish_weight_update`` move the weight version to it; the prefix cache is reset. A
refused adapter closes the update without a version. No PEFT folder is written anywhere.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from dataclasses import asdict
from typing import Any, Callable, Iterator, Optional

import torch
from vllm.distributed.weight_transfer.base import (ModuleSource, ParamMeta,
                                                   TrainerWeightTransferEngine, WeightSource)

from weightsync.core.aio import AsyncRunner
from weightsync.core.errors import SyncTimeout, WeightSyncError
from weightsync.core.plan import dtype_name
from weightsync.integrations.vllm_native.clients import load_adapter, reset_prefix_cache
from weightsync.integrations.vllm_native.info import (WeightsyncInitInfo,
                                                      WeightsyncTrainerInitInfo, check_version,
                                                      weightsync_backend)
from weightsync.rollout.vllm.lora import memory_path
from weightsync.rollout.vllm.serve import free_port
from weightsync.transport.rendezvous import connect

__all__ = ["WeightsyncTrainerEngine", "as_source", "free_port"]


def as_source(source: Any) -> WeightSource:
    """A vLLM ``WeightSource`` as it is, a ``torch.nn.Module`` as its ``ModuleSource``."""
    if isinstance(source, WeightSource):
        return source
    if isinstance(source, torch.nn.Module):
        return ModuleSource(source)
    raise ValueError(f"source must be a vLLM WeightSource or a torch.nn.Module, got "
                     f"{type(source).__name__}")


class _Call:
    """A blocking call in a helper thread, joined with a bound."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self.box: dict = {}
        self.done = threading.Event()
        self.name = name
        threading.Thread(target=self._run, args=(fn,), daemon=True, name=name).start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.box["value"] = fn()
        except BaseException as exc:  # re-raised by result()
            self.box["error"] = exc
        finally:
            self.done.set()

    def failed(self) -> bool:
        return self.done.is_set() and "error" in self.box

    def result(self, timeout: float) -> Any:
        if not self.done.wait(timeout):
            raise SyncTimeout(f"{self.name} did not return within {timeout:.0f} s",
                              peer="vllm", phase=self.name)
        if "error" in self.box:
            raise self.box["error"]
        return self.box.get("value")


class WeightsyncTrainerEngine(TrainerWeightTransferEngine[WeightsyncTrainerInitInfo]):
    """See the module docstring."""

    init_info_cls = WeightsyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Optional[WeightSource] = None,
                 is_sender: bool = True, init_info: Optional[WeightsyncTrainerInitInfo] = None
                 ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info
        self.transport: Any = None
        self.runner = AsyncRunner("weightsync-vllm-trainer")
        self._versions = itertools.count(1)
        self.last: dict = {}

    @property
    def timeout(self) -> float:
        return float(self.transport.config.timeout) if self.transport is not None else 300.0

    @classmethod
    def trainer_init(cls, init_info: WeightsyncTrainerInitInfo, *, client: Any,
                     source: Any = None) -> "WeightsyncTrainerEngine":
        if source is None:
            raise ValueError("weightsync's trainer engine needs a source (a WeightSource or "
                             "an nn.Module)")
        engine = cls(client=client, source=as_source(source), is_sender=init_info.is_sender,
                     init_info=init_info)
        if engine.is_sender:
            engine._join(init_info)
        return engine

    def _join(self, info: WeightsyncTrainerInitInfo) -> None:
        """Host the store, make the workers join through the client, join with them."""
        backend = weightsync_backend(info.backend)
        host = info.host or "127.0.0.1"
        address = info.address or f"{host}:{free_port(host)}"
        token = info.token or secrets.token_hex(16)
        worker_engine = info.shared_options()
        if info.worker_host:
            worker_engine["host"] = info.worker_host
        worker = WeightsyncInitInfo(backend=info.backend, address=address, token=token,
                                    rollout_world_size=info.rollout_world_size,
                                    engine=worker_engine)
        options = info.shared_options()
        options.update({k: getattr(info, k) for k in ("dtype", "host") if getattr(info, k)})
        if "dtype" in options:
            options["dtype"] = getattr(torch, str(options["dtype"]).replace("torch.", ""))
        call = _Call(lambda: self.client.init_weight_transfer_engine(asdict(worker)),
                     "init_weight_transfer_engine")
        joined = _Call(lambda: connect(backend, role="trainer", address=address, token=token,
                                       rollout_world_size=info.rollout_world_size, **options),
                       "weightsync rendezvous")
        limit = float(options.get("timeout") or 300.0) + 30.0
        deadline = time.monotonic() + limit
        while not (call.done.is_set() and joined.done.is_set()):
            if call.failed():     # the workers refused: say why now, not at the timeout
                call.result(0)
            if joined.failed():
                joined.result(0)
            joined.done.wait(0.05)
            if time.monotonic() > deadline:
                break
        call.result(max(0.0, deadline - time.monotonic()))
        self.transport = joined.result(max(0.0, deadline - time.monotonic()))

    def send_weights(self, weight_version: Any = None) -> dict:
        """One update of every vLLM worker to ``weight_version`` (default: 1, 2, ...);
        returns what this rank measured (``seconds``, ``bytes``, ...)."""
        assert self.source is not None
        version = check_version(next(self._versions) if weight_version is None
                                else weight_version)
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:     # stay in the source's collectives
                pass
            return {}
        if self.transport is None:
            raise RuntimeError("weightsync: trainer_init did not join (or shutdown ran)")
        start = time.perf_counter()
        self.client.start_weight_update()
        self.client.update_weights(self._describe(meta, version))
        checked = time.perf_counter()
        metrics = self._transfer(meta, version)
        moved = time.perf_counter()
        self.client.finish_weight_update(weight_version=str(version))
        end = time.perf_counter()
        self.last = {**metrics, "version": version, "seconds": end - start,
                     "check_seconds": checked - start, "transfer_seconds": moved - checked,
                     "finish_seconds": end - moved}
        return self.last

    def _describe(self, meta: list[ParamMeta], version: Any) -> dict:
        cast = self.transport.config.dtype
        dtypes = [dtype_name(cast if cast is not None and m.dtype.is_floating_point
                             else m.dtype) for m in meta]
        return {"phase": "check", "version": version, "names": [m.name for m in meta],
                "shapes": [list(m.shape) for m in meta], "dtypes": dtypes}

    def send_adapter(self, tensors: Any, config: dict, *, name: str,
                     weight_version: Any = None) -> dict:
        """Sync a LoRA adapter (see the module docstring): ``tensors`` (``{peft name:
        tensor}`` or pairs, PEFT's names: ``base_model.model....lora_A.weight``),
        ``config`` (PEFT's ``LoraConfig`` as a dict), ``name`` (what generation requests
        name it by). Returns what this rank measured, with ``adapter_path``."""
        if not self.is_sender:
            return {}
        if self.transport is None:
            raise RuntimeError("weightsync: trainer_init did not join (or shutdown ran)")
        pairs = list(tensors.items() if isinstance(tensors, dict) else tensors)
        version = check_version(next(self._versions) if weight_version is None
                                else weight_version)
        path = memory_path(name, version)
        meta = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in pairs]
        start = time.perf_counter()
        self.client.start_weight_update()
        describe = self._describe(meta, version)
        describe.update(kind="adapter", adapter={"name": name, "config": dict(config)})
        self.client.update_weights(describe)
        checked = time.perf_counter()
        metrics = self._transfer(meta, version, _Pairs(pairs, meta))
        moved = time.perf_counter()
        try:     # live before the version label moves to it
            load_adapter(self.client, name, path)
        except BaseException:
            try:                       # close the update; the label stays where it was
                self.client.finish_weight_update()
            except Exception:  # noqa: BLE001 - the refusal is the error to see
                pass
            raise
        self.client.finish_weight_update(weight_version=str(version))
        reset_prefix_cache(self.client)
        end = time.perf_counter()
        self.last = {**metrics, "version": version, "adapter": name, "adapter_path": path,
                     "seconds": end - start, "check_seconds": checked - start,
                     "transfer_seconds": moved - checked, "finish_seconds": end - moved}
        return self.last

    def _transfer(self, meta: list[ParamMeta], version: Any,
                  source: Optional[WeightSource] = None) -> dict:
        """The workers' receive (an RPC) while this rank streams the tensors."""
        source = self.source if source is None else source
        call = _Call(lambda: self.client.update_weights({"phase": "receive",
                                                         "version": version}),
                     "update_weights")
        limit = 2 * self.timeout + 30.0
        try:
            metrics = self.runner.run(self.transport.send_weights(_checked(source, meta),
                                                                  version),
                                      timeout=limit, phase="send", version=version)
        except BaseException as exc:
            # the workers learn of it through the engine; wait for their update to end
            # (vLLM closes its update session then), and if they failed first, theirs is
            # the cause (ours is only the report of it)
            if call.done.wait(limit) and call.failed() and isinstance(exc, WeightSyncError):
                raise call.box["error"] from exc
            raise
        call.result(limit)
        return dict(metrics or {})

    def shutdown(self) -> None:
        transport, self.transport = self.transport, None
        if transport is not None:
            shut = getattr(self.client, "shutdown_weight_transfer_engine", None)
            try:
                if callable(shut):
                    shut()
            finally:
                transport.finalize()
        self.runner.close()


class _Pairs(WeightSource):
    """A ``WeightSource`` over a list of ``(name, tensor)``."""

    def __init__(self, pairs: list, meta: list[ParamMeta]) -> None:
        self.pairs, self.meta = pairs, meta

    def metadata(self) -> list[ParamMeta]:
        return self.meta

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.pairs)


def _checked(source: WeightSource, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's pairs, each checked against the ``metadata()`` the workers checked."""
    count = 0
    for name, tensor in source:
        want = meta[count] if count < len(meta) else None
        if want is None or name != want.name or tuple(tensor.shape) != tuple(want.shape) \
                or tensor.dtype != want.dtype:
            raise ValueError(f"the WeightSource yielded {name!r} {tuple(tensor.shape)} "
                             f"{tensor.dtype} as item {count}; metadata() declared "
                             f"{want!r}: both must list the same tensors in the same order")
        count += 1
        yield name, tensor
    if count != len(meta):
        raise ValueError(f"the WeightSource yielded {count} tensors, metadata() declared "
                         f"{len(meta)}")
