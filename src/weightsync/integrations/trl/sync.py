"""One TRL trainer's weight syncs into a ``vllm serve`` that runs a weightsync backend.

:class:`ServerSync` is what :class:`~weightsync.integrations.trl.WeightsyncVLLMClient`
(``GRPOTrainer``'s server mode) and :class:`~weightsync.integrations.trl.WeightsyncWeightTransfer`
(``AsyncGRPOTrainer(weight_transfer=...)``) share. It drives vLLM's native weight-transfer
API over HTTP with weightsync's trainer engine
(:class:`~weightsync.integrations.vllm_native.trainer.WeightsyncTrainerEngine`):

* :meth:`ServerSync.connect` reads the server's ``/server_info`` (``VLLM_SERVER_DEV_MODE=1``)
  and refuses, naming the fix, a server without a weight-transfer engine or with one that
  is not weightsync's (TRL's own ``nccl`` cannot run on CPU); then the trainer hosts the
  rendezvous and the server's workers join it (``/init_weight_transfer_engine``).
* :meth:`ServerSync.send` moves one version: the weight set (names, shapes, dtypes) is
  checked by every worker against its checkpoint before a byte moves, then the tensors
  stream through the weightsync transport, and the workers apply the version completely
  or not at all. TRL's ``(name, dtype, shape)`` metadata is used when given; without it
  (``AsyncGRPOTrainer`` passes only an iterator) the first sync collects the pairs before
  sending (references to the trainer's tensors: no copy unless the iterator makes one,
  e.g. FSDP2's ``full_tensor()``), and later syncs reuse the names, shapes and dtypes.
* Every sync is bounded by ``weight_sync_timeout`` (TRL's ``AsyncGRPOConfig`` field of that
  name): past it the call raises :class:`~weightsync.core.errors.SyncTimeout` and the
  connection is dropped (the server's receive ends, nothing is applied); the next sync
  joins again. The bound covers the trainer's own export too: the iterator runs inside the
  bounded call, so a gather that never returns (FSDP2 with a dead rank) cannot hang the
  trainer past it.
* A failed sync raises a :class:`~weightsync.core.errors.WeightSyncError` (weightsync's
  own errors keep their type; any other cause is wrapped in :class:`SyncAborted`) whose
  text says which version the server still serves: a weightsync backend never keeps a
  partially updated model, whatever TRL's own NCCL error text says about its backend.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from weightsync.core.errors import SyncTimeout, WeightSyncError
from weightsync.integrations.vllm_native.info import (BACKENDS, PREFIX, trainer_init_info,
                                                      weightsync_backend)
from weightsync.rollout.vllm.serve import HTTPWeightSyncClient, VLLMServerError

__all__ = ["ServerSync", "SyncOptions", "SyncAborted", "server_backend"]

logger = logging.getLogger(__name__)

#: Options of weightsync's trainer engine a TRL user may set (see
#: :class:`~weightsync.integrations.vllm_native.info.WeightsyncTrainerInitInfo`).
ENGINE_FIELDS = ("bucket_size", "num_slots", "checksum", "dtype", "host", "worker_host")


class SyncAborted(WeightSyncError):
    """A TRL weight sync failed for a reason outside weightsync (the trainer's iterator
    raised, the server refused a call); the server kept the version it served before."""


@dataclass(kw_only=True)
class SyncOptions:
    """How a TRL trainer syncs into the server.

    ``backend``: the weightsync backend (``"shm"``, ``"collective"``, ``"nixl"``,
    ``"cuda_ipc"``, with or without the ``weightsync-`` prefix); None takes the one the
    server runs. ``weight_sync_timeout``: seconds one sync may take end to end (TRL's
    ``AsyncGRPOConfig.weight_sync_timeout``, default 1800 as there). ``control_timeout``:
    seconds for the small HTTP calls (pause, resume, server info). ``engine``: options of
    weightsync's trainer engine (``bucket_size``, ``num_slots``, ``checksum``, ``dtype``,
    ``host``, ``worker_host``).
    """

    backend: Optional[str] = None
    weight_sync_timeout: float = 1800.0
    control_timeout: float = 300.0
    engine: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend is not None:
            name = self.backend if str(self.backend).startswith(PREFIX) else PREFIX + str(
                self.backend)
            weightsync_backend(name)          # ValueError naming the known ones
            self.backend = name
        for key in ("weight_sync_timeout", "control_timeout"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{key} must be a positive number of seconds, got {value!r}")
            setattr(self, key, float(value))
        if not isinstance(self.engine, dict):
            raise ValueError(f"engine must be a dict of engine options, got {self.engine!r}")
        unknown = sorted(set(self.engine) - set(ENGINE_FIELDS))
        if unknown:
            raise ValueError(f"unknown engine options {unknown}; known: {list(ENGINE_FIELDS)}")
        # the trainer init info validates the values (types, ranges) now, not at connect
        trainer_init_info(self.backend or PREFIX + BACKENDS[0], rank=0, **self.engine)


def server_backend(server_info: dict, base_url: str, wanted: Optional[str] = None) -> str:
    """The weightsync backend of a server's ``/server_info`` ``vllm_config``; ``ValueError``
    naming the fix when it runs none, another one, or not the ``wanted`` one."""
    config = server_info.get("weight_transfer_config")
    backend = config.get("backend") if isinstance(config, dict) else None
    start = (f"start it with VLLM_SERVER_DEV_MODE=1 vllm serve <model> --weight-transfer-config "
             f"'{{\"backend\": \"{wanted or PREFIX + BACKENDS[0]}\"}}'")
    if backend is None:
        raise ValueError(f"the vLLM server at {base_url} has no weight-transfer engine: {start}")
    if not str(backend).startswith(PREFIX):
        raise ValueError(f"the vLLM server at {base_url} runs the weight-transfer backend "
                         f"{backend!r}, not a weightsync one ({[PREFIX + b for b in BACKENDS]}); "
                         f"{start}")
    weightsync_backend(backend)
    if wanted is not None and backend != wanted:
        raise ValueError(f"the vLLM server at {base_url} runs {backend!r}, but {wanted!r} was "
                         f"asked for; {start}, or ask for {backend!r}")
    return str(backend)


class _Stream(WeightSource):
    """A vLLM ``WeightSource`` over one sync's metadata and ``(name, tensor)`` pairs."""

    def __init__(self) -> None:
        self.meta: list = []
        self.pairs: Optional[Iterator] = None

    def metadata(self) -> list:
        return self.meta

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        pairs, self.pairs = self.pairs, None
        if pairs is None:
            raise RuntimeError("weightsync: this sync's tensors were already streamed")
        yield from pairs


def _dtype(name: Any) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the weight metadata")
    return value


class _Bounded:
    """``fn()`` in a daemon thread, waited for with a bound."""

    def __init__(self, fn: Any, name: str) -> None:
        self.box: dict = {}
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(fn,), daemon=True, name=name).start()

    def _run(self, fn: Any) -> None:
        try:
            self.box["value"] = fn()
        except BaseException as exc:  # re-raised by the waiter
            self.box["error"] = exc
        finally:
            self.done.set()


class ServerSync:
    """See the module docstring. ``base_url``: the server (``http://host:port``)."""

    def __init__(self, base_url: str, options: Optional[SyncOptions] = None) -> None:
        self.options = options if options is not None else SyncOptions()
        if not isinstance(self.options, SyncOptions):
            raise ValueError(f"options must be a SyncOptions, got {type(self.options).__name__}")
        self.base_url = str(base_url).rstrip("/")
        self.http = HTTPWeightSyncClient(self.base_url,
                                         timeout=self.options.weight_sync_timeout)
        self.backend: Optional[str] = None
        self.engine: Any = None
        self._source = _Stream()
        self._meta: Optional[list] = None         # (name, dtype, shape) of the last sync
        self._versions: Optional[Iterator[int]] = None   # from the server's, see connect
        self._lock = threading.Lock()
        self.last: dict = {}

    # -- the server ---------------------------------------------------------------------
    def server_info(self) -> dict:
        """The server's resolved ``vllm_config`` (``/server_info``, dev mode)."""
        try:
            out = self.http.request("GET", "/server_info?config_format=json",
                                    timeout=self.options.control_timeout)
        except VLLMServerError as exc:
            if exc.status == 404:
                raise ValueError(f"the vLLM server at {self.base_url} does not expose its "
                                 "development endpoints (/server_info, /init_weight_transfer_"
                                 "engine, ...): restart it with VLLM_SERVER_DEV_MODE=1 in its "
                                 "environment") from None
            raise
        return out["vllm_config"] if isinstance(out, dict) and "vllm_config" in out else out

    def served_version(self) -> Optional[str]:
        """The weight version the server reports now (None if it does not answer)."""
        try:
            return self.http.weight_version(timeout=min(10.0, self.options.control_timeout))
        except Exception:
            return None

    def wait_ready(self, timeout: float) -> None:
        self.http.wait_healthy(timeout)

    # -- lifecycle ----------------------------------------------------------------------
    def connect(self) -> None:
        """Check the server and join its workers (bounded by ``weight_sync_timeout``)."""
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        info = self.server_info()
        self.backend = server_backend(info, self.base_url, self.options.backend)
        world = self.http.world_size(timeout=self.options.control_timeout)
        if self._versions is None:    # go on from a numbered version a server already holds
            served = self.served_version() or ""
            self._versions = itertools.count(int(served) + 1 if served.isdigit() else 1)
        init = trainer_init_info(self.backend, rank=0, rollout_world_size=world,
                                 timeout=self.options.weight_sync_timeout,
                                 **self.options.engine)
        self.close()
        self.engine = self._bounded(
            lambda: WeightTransferTrainerFactory.trainer_init(init, client=self.http,
                                                              source=self._source),
            "connect", None)
        logger.info("weightsync: joined the %d worker(s) of %s (%s)", world, self.base_url,
                    self.backend)

    def close(self) -> None:
        """Leave the server's workers (they drop the connection; weights stay)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                self._bounded(engine.shutdown, "close", None, limit=self.options.control_timeout)
            except Exception as exc:
                logger.warning("weightsync: leaving %s failed: %s", self.base_url, exc)

    # -- one sync -----------------------------------------------------------------------
    def send(self, metadata: Optional[Sequence] = None,
             pairs: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
             version: Any = None) -> dict:
        """Sync one version: ``metadata`` is TRL's ``[(name, dtype, shape), ...]`` (or
        None, see the module docstring), ``pairs`` the ``(name, tensor)`` stream in that
        order; ``version`` defaults to the next number after the server's version when
        that is a number (1, 2, ... otherwise). Returns what was measured (``seconds``,
        ``bytes``, ``version``, ...)."""
        if pairs is None:
            raise ValueError("send needs the (name, tensor) pairs")
        with self._lock:
            if self.engine is None:
                self.connect()
            version = next(self._versions) if version is None else version
            if metadata is None and self._meta is None:
                items = list(pairs)           # the first sync without metadata: learn it
                metadata = [(n, t.dtype, tuple(t.shape)) for n, t in items]
                pairs = iter(items)
            meta = self._describe(metadata if metadata is not None else self._meta)
            self._source.meta = meta
            self._source.pairs = iter(pairs)
            engine = self.engine
            try:
                stats = self._run(lambda: engine.send_weights(weight_version=version),
                                  engine, version, "weights")
            finally:
                self._source.pairs = None
            self._meta = [(m.name, m.dtype, m.shape) for m in meta]
            self.last = dict(stats)
            return self.last

    def send_adapter(self, tensors: Any, config: dict, *, name: str,
                     version: Any = None) -> dict:
        """Sync a LoRA adapter into the server's memory and load it as ``name`` (the
        server runs ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``):
        ``tensors`` ``{PEFT name: tensor}``, ``config`` PEFT's ``LoraConfig`` as a dict.
        No PEFT folder is written. Bounded and failing as :meth:`send`; a failed sync
        leaves the adapters loaded before it serving."""
        with self._lock:
            if self.engine is None:
                self.connect()
            version = next(self._versions) if version is None else version
            engine = self.engine
            stats = self._run(lambda: engine.send_adapter(tensors, config, name=name,
                                                          weight_version=version),
                              engine, version, "adapter")
            self.last = dict(stats)
            return self.last

    def _run(self, fn: Any, engine: Any, version: Any, what: str) -> dict:
        try:
            return self._bounded(fn, "send", version)
        except BaseException as exc:
            if self.engine is engine:         # the next sync joins again, from a clean state
                self.close()
            err = self._failed(exc, version, what)
            if err is exc:
                raise
            raise err from exc

    @staticmethod
    def _describe(metadata: Sequence) -> list:
        out = []
        for entry in metadata:
            if isinstance(entry, ParamMeta):
                out.append(entry)
                continue
            name, dtype, shape = entry
            out.append(ParamMeta(str(name), _dtype(dtype), tuple(int(d) for d in shape)))
        if not out:
            raise ValueError("a weight sync needs at least one tensor")
        return out

    def _bounded(self, fn: Any, phase: str, version: Any,
                 limit: Optional[float] = None) -> Any:
        limit = self.options.weight_sync_timeout if limit is None else limit
        call = _Bounded(fn, f"weightsync-trl-{phase}")
        if not call.done.wait(limit):
            self._abandon()
            raise SyncTimeout(f"the {phase} with the vLLM server at {self.base_url} did not "
                              f"finish within weight_sync_timeout={limit:.0f} s; the connection "
                              "was dropped (the next sync joins again)", peer=self.base_url,
                              phase=phase, version=version)
        if "error" in call.box:
            raise call.box["error"]
        return call.box.get("value")

    def _abandon(self) -> None:
        """Drop the engine after a call past its bound: its transport is closed in the
        background, which ends the workers' receive (nothing is applied)."""
        engine, self.engine = self.engine, None
        transport = getattr(engine, "transport", None)
        if transport is not None:
            threading.Thread(target=_quietly, args=(transport.finalize,), daemon=True,
                             name="weightsync-trl-abandon").start()

    def _failed(self, exc: BaseException, version: Any, what: str = "weights"
                ) -> BaseException:
        """``exc`` as a WeightSyncError that says what the server serves now."""
        served = self.served_version()
        if served is None:
            note = f"the vLLM server at {self.base_url} did not answer after the failure"
        elif what == "adapter":
            note = (f"the vLLM server at {self.base_url} kept serving weight version "
                    f"{served!r} and the adapters it had loaded: weightsync loads an adapter "
                    "only once all of it arrived")
        else:
            note = (f"the vLLM server at {self.base_url} kept serving weight version "
                    f"{served!r}: weightsync applies a version completely or not at all, so "
                    "no partially updated weights are served")
        if isinstance(exc, WeightSyncError):
            exc.add_note(note)
            return exc
        if isinstance(exc, VLLMServerError) and exc.error is not None:
            detail = exc.error.get("message", exc.message)
        else:
            detail = f"{type(exc).__name__}: {exc}"
        return SyncAborted(f"the weight sync of version {version!r} failed ({detail}); {note}",
                           peer=self.base_url, phase="send", version=version)


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception:
        logger.debug("weightsync: closing an abandoned connection failed", exc_info=True)
