"""The checkpoint-engine contract.

Lifecycle, the same on both sides (trainer workers send, rollout workers receive)::

    engine = CheckpointEngineRegistry.new(name, bucket_size=..., timeout=..., role=...)
    meta = engine.prepare()                     # every worker; returns a small dict
    trainer_kw, rollout_kw = Engine.build_topology(A, R, [meta of trainer ranks..., meta
                                                          of rollout ranks...])
    # trainer_kw = {"rank": [0, 1, ...], "token": [...], ...}: one list entry per worker
    engine.init_process_group(**worker_kwargs(trainer_kw, i))   # every worker, concurrently
    await engine.send_weights(named_tensors, version)        # trainer ranks
    async for name, t in engine.receive_weights(version):    # rollout ranks
        ...
    engine.finalize()                           # releases buffers, sockets, groups

Backend options (``ShmOptions``, ``CollectiveOptions``, ``CudaIpcOptions``,
``NixlOptions``; ``CodecOptions`` for the codec names) are keyword arguments of the same
call (``new("shm", direct=False)``) or one object (``new("shm", options=ShmOptions(...))``);
keywords given beside ``options=`` override its fields.

``init_process_group`` is done once; ``send_weights``/``receive_weights`` run as many
syncs as wanted on the same engines; ``finalize`` ends it (``prepare`` may start again).

The blocking forms do the same from plain synchronous code (``weightsync.connect`` does the
first four steps)::

    stats = engine.send(model.state_dict(), version=3)          # trainer ranks
    stats = engine.receive(into=model.state_dict(), version=3)  # rollout ranks
    print(stats)   # version 3: ... tensors, ... MB in ... s (... GB/s)
    weights = engine.receive(version=3)   # no ``into``: a dict of copies

Rules every backend keeps (the conformance suite checks them):

* Trainer ranks each pass an iterable (or async iterable) of ``(name, tensor)``. A name
  yielded by several ranks is delivered once; ownership is spread over the ranks. Every
  rank must walk its iterable to the end (producing a tensor may be a collective).
* Tensors handed to ``send_weights`` may be views valid only until the next item.
* Every rollout rank receives the union of the names, each exactly once, bit-exact after
  the optional ``dtype`` cast. A tensor yielded by ``receive_weights`` may be a view into
  the engine's buffer: it is valid until the iterator is advanced; copy it to keep it.
* ``version`` travels with the data. A receiver that expects another version raises
  :class:`~weightsync.core.errors.VersionMismatch` instead of yielding weights.
* Every wait is bounded by ``timeout``; failures raise a
  :class:`~weightsync.core.errors.WeightSyncError` naming peer, phase and version.
"""

from __future__ import annotations

import abc
import asyncio
import threading
import time
from dataclasses import dataclass
from typing import (Any, AsyncIterator, Awaitable, ClassVar, Iterable, Mapping, Optional, Union,
                    overload)

import torch

from weightsync.core.config import EngineConfig, build_options, option_names
from weightsync.core.errors import PlanMismatch, SyncTimeout, TopologyError, WeightSyncError
from weightsync.core.remote import normalize_version

__all__ = ["CheckpointEngine", "CONFIG_KEYS", "NamedTensors", "SyncStats", "check_topology",
           "worker_kwargs", "per_worker", "validate_topology"]

#: Keyword arguments every engine takes (:class:`~weightsync.core.config.EngineConfig`).
CONFIG_KEYS = ("bucket_size", "timeout", "device", "dtype", "num_slots", "checksum", "role",
               "host")

NamedTensors = Union[Iterable[tuple[str, torch.Tensor]], Any]  # or an async iterable


@dataclass(frozen=True)
class SyncStats:
    """What one blocking :meth:`CheckpointEngine.send` or :meth:`CheckpointEngine.receive`
    moved: ``tensors`` and ``bytes`` (a sender counts what its backend sent for this rank,
    a receiver what it received), ``seconds`` of wall time of the call, ``gbps``
    (``bytes / seconds / 1e9``) and the ``version``."""

    version: Any
    tensors: int
    bytes: int
    seconds: float
    gbps: float

    @classmethod
    def of(cls, version: Any, tensors: int, nbytes: int, seconds: float) -> "SyncStats":
        return cls(version=version, tensors=int(tensors), bytes=int(nbytes),
                   seconds=float(seconds),
                   gbps=nbytes / seconds / 1e9 if seconds > 0 else 0.0)

    def __str__(self) -> str:
        return (f"version {self.version!r}: {self.tensors} tensors, {self.bytes / 1e6:.3f} MB "
                f"in {self.seconds:.4f} s ({self.gbps:.3f} GB/s)")


class CheckpointEngine(abc.ABC):
    """Abstract transport backend. Subclasses register with ``CheckpointEngineRegistry``.

    ``capabilities`` says what a backend can do: ``"cpu"``/``"cuda"`` (tensor devices),
    ``"same_process"``, ``"same_host"``, ``"multi_host"``.
    """

    backend_name: ClassVar[str] = ""
    capabilities: ClassVar[frozenset[str]] = frozenset()
    #: The backend's options dataclass (``None``: only :class:`EngineConfig`'s settings).
    #: Its fields are keyword arguments of the engine; ``options=`` takes a whole instance.
    options_cls: ClassVar[Optional[type]] = None

    def __init__(self, *, options: Any = None, **kwargs: Any) -> None:
        own = option_names(type(self).options_cls)
        known = set(CONFIG_KEYS) | set(own)
        unknown = set(kwargs) - known
        name = type(self).backend_name or type(self).__name__
        if unknown:
            raise ValueError(
                f"unknown option(s) {sorted(unknown)} for backend {name!r}; known: "
                f"{sorted(known) + (['options'] if own else [])}")
        self.config = EngineConfig(**{k: v for k, v in kwargs.items()
                                      if v is not None and k in CONFIG_KEYS})
        #: this backend's options (an instance of ``options_cls``), or ``None``
        self.options = build_options(type(self).options_cls, options,
                                     {k: v for k, v in kwargs.items() if k in own},
                                     owner=f"backend {name!r}")

    # -- lifecycle -----------------------------------------------------------------------

    @abc.abstractmethod
    def prepare(self) -> dict[str, Any]:
        """Set up what peers must know before the topology is built; return it (JSON-able)."""

    @classmethod
    @abc.abstractmethod
    def build_topology(
        cls, trainer_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """From every worker's ``prepare()`` result (trainer ranks first, then rollout
        ranks), the keyword arguments of ``init_process_group``: one dict per side, mapping
        each keyword to a list with one value per worker of that side (verl's shape).
        :func:`worker_kwargs` picks one worker's entry."""

    @abc.abstractmethod
    def init_process_group(self, **kwargs: Any) -> None:
        """Join the group described by this worker's entry of ``build_topology``."""

    @abc.abstractmethod
    async def send_weights(self, named_tensors: NamedTensors, version: Any = None) -> dict[str, Any]:
        """Send one version of the weights; returns metrics (bytes, seconds, ...)."""

    @abc.abstractmethod
    def receive_weights(self, version: Any = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Async iterator over ``(name, tensor)`` of one version."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Release every buffer, segment, socket, thread and group. Idempotent."""

    async def receive_into(self, params: Mapping[str, torch.Tensor], version: Any = None
                           ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Receive one version into the receiver's own tensors (e.g. its model's).

        Each received tensor whose name is in ``params`` is copied into ``params[name]``
        (``copy_`` semantics: dtype cast, any layout) and yielded as ``(name,
        params[name])``; other names are yielded as :meth:`receive_weights` yields them.
        Backends that can land bytes straight in those tensors override this (the bucketed
        backends do), so no copy is left to the caller.
        """
        async for name, tensor in self.receive_weights(version):
            dest = params.get(name)
            if dest is None:
                yield name, tensor
                continue
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"receive_into: {name} has shape {tuple(tensor.shape)}, "
                                 f"params[{name!r}] has {tuple(dest.shape)}")
            dest.copy_(tensor)
            yield name, dest

    # -- blocking forms ------------------------------------------------------------------

    def send(self, weights: Any, *, version: Any = None,
             timeout: Optional[float] = None) -> SyncStats:
        """Send one version and return when it is sent: :meth:`send_weights` for callers
        without an event loop.

        ``weights``: a state dict (any mapping of name -> tensor), an ``nn.Module`` (its
        ``state_dict()``) or an iterable of ``(name, tensor)``. Every wait inside is
        bounded by the engine's ``timeout`` (a dead peer raises within it, naming it); the
        whole call by ``timeout`` (default: twice the engine's plus 30 s). Runs on a private
        event loop in a helper thread, so it may be called from any thread that does not
        itself run an event loop (there, ``await send_weights(...)``).
        """
        items, limit = _items_of(weights), self._plain_timeout(timeout)
        version = normalize_version(version)
        start = time.perf_counter()
        metrics = _block(self.send_weights(items, version=version), what="send", timeout=limit,
                         version=version, waits_for="rollout ranks") or {}
        seconds = time.perf_counter() - start
        return SyncStats.of(version, metrics.get("tensors", 0), metrics.get("bytes", 0), seconds)

    @overload
    def receive(self, into: None = None, *, version: Any = None, strict: bool = True,
                timeout: Optional[float] = None) -> dict[str, torch.Tensor]: ...

    @overload
    def receive(self, into: Union[Mapping[str, torch.Tensor], torch.nn.Module], *,
                version: Any = None, strict: bool = True,
                timeout: Optional[float] = None) -> SyncStats: ...

    def receive(self, into: Any = None, *, version: Any = None, strict: bool = True,
                timeout: Optional[float] = None) -> Any:
        """Receive one version and return when every tensor of it has arrived: the
        blocking form of :meth:`receive_into` / :meth:`receive_weights`.

        ``into``: the receiver's own tensors, a mapping of name -> tensor or an
        ``nn.Module`` (its ``state_dict()``, whose tensors are the module's own). Each
        received tensor is written into the one of its name (``copy_`` semantics: dtype
        cast, any layout; backends land the bytes there directly where they can) and a
        :class:`SyncStats` is returned. ``strict``: a name received but not in ``into``,
        or in ``into`` but not received, raises :class:`~weightsync.core.errors.PlanMismatch`
        once the stream has ended (with ``strict=False`` such names are skipped).
        Without ``into``: returns a dict of name -> a copy of each received tensor.

        ``version``: the version expected (``None``: any). Timeouts and threads: as
        :meth:`send`.
        """
        version, limit = normalize_version(version), self._plain_timeout(timeout)
        if into is None:
            received: dict[str, torch.Tensor] = {}

            async def collect() -> None:
                async for name, tensor in self.receive_weights(version):
                    received[name] = tensor.clone()

            _block(collect(), what="receive", timeout=limit, version=version,
                   waits_for="trainer ranks")
            return received
        if isinstance(into, torch.nn.Module):
            into = into.state_dict()
        if not isinstance(into, Mapping):
            raise ValueError(f"into must be a mapping of name -> tensor or an nn.Module, got "
                             f"{type(into).__name__}")
        # detached views share the parameters' storage and take in-place writes
        targets = {n: t.detach() for n, t in into.items()}
        counts = {"tensors": 0, "bytes": 0}
        unexpected: list[str] = []
        seen: set[str] = set()

        async def land() -> None:
            async for name, tensor in self.receive_into(targets, version):
                seen.add(name)
                dest = targets.get(name)
                if dest is None:
                    unexpected.append(name)
                    continue
                if tensor is not dest:
                    if tuple(dest.shape) != tuple(tensor.shape):
                        raise ValueError(f"receive: {name} has shape {tuple(tensor.shape)}, "
                                         f"into[{name!r}] has {tuple(dest.shape)}")
                    dest.copy_(tensor)
                counts["tensors"] += 1
                counts["bytes"] += tensor.numel() * tensor.element_size()

        start = time.perf_counter()
        _block(land(), what="receive", timeout=limit, version=version, waits_for="trainer ranks")
        seconds = time.perf_counter() - start
        missing = sorted(set(targets) - seen)
        if strict and (unexpected or missing):
            raise PlanMismatch(f"receive: {len(unexpected)} tensor(s) received that into has "
                               f"no place for {sorted(unexpected)[:5]}, {len(missing)} of into "
                               f"not received {missing[:5]} (strict=False skips them)",
                               peer="trainer ranks", phase="receive", version=version)
        return SyncStats.of(version, counts["tensors"], counts["bytes"], seconds)

    def _plain_timeout(self, timeout: Optional[float]) -> float:
        if timeout is None:
            return 2 * self.config.timeout + 30
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(timeout)

    # -- helpers -------------------------------------------------------------------------

    def abort_receive(self, error: Any, version: Any = None) -> None:
        """Rollout: fail the sync this engine would receive next, without reading it (its
        consumer failed before it began: a loader that refuses, a check that raises).

        The trainer ranks end that sync at once with ``error``'s text (an exception or a
        message) and tell every other peer of it, instead of waiting out the timeout for
        a receiver that never comes; each raises a
        :class:`~weightsync.core.errors.PeerFailed` naming this rollout rank. The sync counts
        as done (failed) here, so this engine stays in step with the trainer ranks; as after
        any failed sync, re-initialize the group before the next one (the managers do).
        Best effort: a peer already gone is not an error. A backend that cannot tell its
        peers (the default hook) leaves them to their timeout."""
        if not isinstance(error, BaseException):
            error = WeightSyncError(str(error))
        self._abort_unread(error, normalize_version(version))

    def _abort_unread(self, error: BaseException, version: Any) -> None:
        """Hook of :meth:`abort_receive`: tell the trainer ranks (see there)."""

    def reset_plan(self) -> None:
        """Forget cached plans: the next sync re-sends its layout (weight set changed)."""

    def __enter__(self) -> "CheckpointEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finalize()


def _items_of(weights: Any) -> Any:
    """``(name, tensor)`` pairs of a state dict, a module or an iterable of pairs."""
    if isinstance(weights, torch.nn.Module):
        return weights.state_dict().items()
    if isinstance(weights, Mapping):
        return weights.items()
    if isinstance(weights, (str, bytes, torch.Tensor)) or not (
            hasattr(weights, "__iter__") or hasattr(weights, "__aiter__")):
        raise ValueError("weights must be a state dict, an nn.Module or an iterable of "
                         f"(name, tensor), got {type(weights).__name__}")
    return weights


def _block(coro: Awaitable[Any], *, what: str, timeout: float, version: Any,
           waits_for: str) -> Any:
    """Run ``coro`` to its end on a private event loop in a helper thread; at most
    ``timeout`` seconds (then it is cancelled, which tells the peers, and
    ``SyncTimeout`` names ``waits_for``). Refused in a thread that runs an event loop:
    blocking there would stall that loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        getattr(coro, "close", lambda: None)()
        async_form = "send_weights" if what == "send" else "receive_into / receive_weights"
        raise RuntimeError(f"engine.{what}() blocks and this thread runs an event loop: "
                           f"await engine.{async_form}(...) there, or call {what}() from "
                           "another thread")
    result: dict[str, Any] = {}

    async def bounded() -> None:
        task = asyncio.ensure_future(coro)
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            result["expired"] = True
            task.cancel()
            await asyncio.wait({task})   # the cancelled coroutine tells its peers
        result["value"] = task.result()

    def main() -> None:
        try:
            asyncio.run(bounded())
        except BaseException as exc:  # handed to the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=main, name=f"weightsync-{what}", daemon=True)
    thread.start()
    thread.join(timeout + 30.0)
    if thread.is_alive() or result.get("expired"):
        raise SyncTimeout(f"{what} did not finish within {timeout:.1f}s", peer=waits_for,
                          phase=what, version=version) from None
    if "error" in result:
        raise result["error"]
    return result.get("value")


def check_topology(
    backend: str, trainer_world_size: int, rollout_world_size: int, metadata: list,
) -> None:
    """Validate ``build_topology`` inputs with clear errors."""
    for name, value in (("trainer_world_size", trainer_world_size),
                        ("rollout_world_size", rollout_world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{backend}: {name} must be an int >= 1, got {value!r}")
    if not isinstance(metadata, (list, tuple)):
        raise ValueError(f"{backend}: metadata must be a list of prepare() results")
    expected = trainer_world_size + rollout_world_size
    if len(metadata) != expected:
        raise TopologyError(
            f"{backend}: build_topology got {len(metadata)} prepare() results, expected "
            f"{trainer_world_size} trainer + {rollout_world_size} rollout = {expected}",
            phase="build_topology")


def version_matches(expected: Optional[Any], got: Any) -> bool:
    """``None`` expects any version."""
    return expected is None or expected == got


def per_worker(entries: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Turn a list of per-worker dicts into verl's dict of per-worker lists."""
    keys = entries[0].keys() if entries else ()
    return {k: [e[k] for e in entries] for k in keys}


def worker_kwargs(kwargs: dict[str, list[Any]], index: int) -> dict[str, Any]:
    """The ``init_process_group`` keywords of worker ``index`` of one side."""
    return {k: v[index] for k, v in kwargs.items()}


def validate_topology(backend: str, side: str, kwargs: Any, size: int) -> None:
    """Every value must be a list with one entry per worker (``TopologyError`` otherwise)."""
    if not isinstance(kwargs, dict):
        raise TopologyError(f"{backend}: build_topology must return dicts of lists, got "
                            f"{type(kwargs).__name__} for the {side} side", phase="build_topology")
    for key, value in kwargs.items():
        if not isinstance(value, (list, tuple)) or len(value) != size:
            got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise TopologyError(
                f"{backend}: build_topology gave key {key!r} of the {side} side {got} "
                f"entries, but the {side} side has {size} workers", phase="build_topology")
