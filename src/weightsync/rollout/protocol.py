"""The rollout adapter protocol the manager talks to, and a base for in-process engines.

A *rollout adapter* wraps one inference replica (HF transformers, vLLM, ...). The manager
(:mod:`weightsync.orchestration.manager`) drives it through these calls only:

* engine lifecycle: ``engine_prepare(backend, engine_kwargs) -> [meta, ...]`` (one entry
  per receiving rank the replica hosts), ``engine_init([kwargs, ...])``,
  ``engine_receive(version, kind=..., adapter_config=...) -> stats``, ``engine_finalize()``
  and ``execute_checkpoint_engine(method, *args, **kwargs)``;
* generation control: ``pause(abort=True)``, ``resume()``, ``sleep(level)``,
  ``wake_up(tags)`` (tags ``"weights"`` and ``"kv_cache"``), ``reset_caches()``;
* state: ``current_version()``, ``capabilities()``, ``call_log()``;
* optional (used when present): ``begin_sync(version, kinds)`` (fence generation until
  every round of ``version`` is applied), ``check_weights(offered, kind=...,
  adapter_config=...) -> [[name, why], ...]`` (validation before any byte moves),
  ``weight_digests(kind) -> {"digests": {...}, "dtypes": {...}}`` (for
  ``CheckpointEngineManager.verify``), ``fence(reason)``, ``sync_state()``;
* atomic syncs (kinds in ``capabilities()["staged_kinds"]``): ``begin_sync(version, kinds,
  staged=True)`` (receive into a staging copy, the live weights untouched and unfenced),
  ``commit_sync(version)`` (swap it in, keep the old copy), ``abort_sync(version)`` (drop
  it, or swap the old copy back), ``release_sync(version)`` (drop the old copy).

**No mixed versions** (:class:`SyncFence`): a replica generates only with a complete
version. Generation is fenced from ``begin_sync`` (the manager calls it right after
``pause``) until every tensor of every round of that version has been applied and checked
(all of the model's tensors written, shapes equal, checksums if enabled); a round that
fails leaves the replica fenced until a later sync completes. ``generate`` refuses while
fenced, and every :class:`Generation` carries the version that produced it. Each adapter
holds one :class:`SyncFence` (``_fence``), the only answer to "may it generate now"
(``SyncFence.blocked``); :class:`ReplicaControls` gives it ``begin_sync``, ``fence`` and
``sync_state`` on top of it.

``kind`` of a sync: ``"full"`` (every weight, merged if LoRA), ``"base"`` (base weights of a
LoRA model, unmerged), ``"adapter"`` (LoRA tensors plus ``adapter_config``, PEFT's JSON).

Sleep levels follow vLLM: level 1 moves weights off the device (kept) and drops the KV
cache; level 2 discards both, so the weights must be restored by a sync before use.
``capabilities()["full_sync_restores_discarded"]`` says whether a full sync restores
everything level 2 discarded (the manager caps the level at 1 otherwise).

:class:`LocalEngineRollout` hosts one receiving engine in the adapter's own process and
leaves ``load_weights`` (consume the stream into the model) to subclasses. An adapter
whose model lives in other processes (vLLM workers) implements the ``engine_*`` calls by
hosting engines there instead. :func:`execute_on_engine` is the one implementation of
``execute_checkpoint_engine`` once an engine is at hand: :class:`LocalEngineRollout`, the
vLLM worker extension (:mod:`weightsync.rollout.vllm.extension`) and the trainer mixin of
:mod:`weightsync.integrations.ray.mixins` call it.

Used by the rollout adapters (:mod:`.hf`, :mod:`.vllm`) and the Ray mixins of
:mod:`weightsync.integrations`; the manager reaches adapters only through those mixins.
"""

from __future__ import annotations

import abc
import collections
import inspect
import threading
import time
from dataclasses import dataclass
from typing import (Any, AsyncIterator, Callable, Optional, Protocol, Sequence,
                    runtime_checkable)

import torch

from weightsync.core.aio import AsyncRunner
from weightsync.transport.registry import CheckpointEngineRegistry
from weightsync.transport.codec import carry_codec_state
from weightsync.core.config import SLEEP_LEVELS, WAKE_TAGS, WEIGHT_KINDS
from weightsync.core.errors import SyncTimeout, WeightSyncError

__all__ = ["RolloutAdapter", "LocalEngineRollout", "Generation", "GenerationGate", "SyncFence",
           "ReplicaControls", "SLEEP_LEVELS", "WAKE_TAGS", "WEIGHT_KINDS", "check_tags",
           "execute_on_engine", "ReceiveStream"]


def check_tags(tags: Optional[Sequence[str]]) -> tuple[str, ...]:
    if tags is None:
        return WAKE_TAGS
    if isinstance(tags, str):
        tags = [tags]
    bad = [t for t in tags if t not in WAKE_TAGS]
    if bad or not tags:
        raise ValueError(f"wake_up tags must be a non-empty subset of {WAKE_TAGS}, got {tags!r}")
    return tuple(tags)


def execute_on_engine(engine: Any, method: Any, args: Sequence, kwargs: dict,
                      runner: AsyncRunner, *, peer: Optional[str] = None) -> Any:
    """``execute_checkpoint_engine`` on a hosted ``engine``: call its public ``method``; an
    awaitable result runs on ``runner`` to completion, bounded by twice the engine's timeout
    plus 30 s; a weight stream (an async iterator) is refused: a sync consumes those."""
    if not isinstance(method, str) or method.startswith("_") or \
            not callable(getattr(engine, method, None)):
        raise ValueError(f"{type(engine).__name__} has no public method {method!r}")
    result = getattr(engine, method)(*args, **kwargs)
    if inspect.isasyncgen(result):
        raise ValueError(f"{method} is an async iterator; use a sync (engine_receive)")
    if inspect.isawaitable(result):
        result = runner.run(result, timeout=2 * engine.config.timeout + 30, phase=method,
                            peer=peer)
    return result


@dataclass
class Generation:
    """One generated sequence and the weight version that produced it."""

    prompt: list
    tokens: list
    version: Any
    aborted: bool = False
    logits: Optional[torch.Tensor] = None   # [new tokens, vocab] raw logits when asked


@runtime_checkable
class RolloutAdapter(Protocol):
    def engine_prepare(self, backend: str, engine_kwargs: dict) -> list: ...
    def engine_init(self, kwargs_list: list) -> None: ...
    def engine_receive(self, version: Any, *, kind: str = "full",
                       adapter_config: Optional[dict] = None) -> dict: ...
    def engine_finalize(self) -> None: ...
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any: ...
    def pause(self, *, abort: bool = True) -> None: ...
    def resume(self) -> None: ...
    def sleep(self, level: int = 1) -> None: ...
    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None: ...
    def reset_caches(self) -> None: ...
    def current_version(self) -> Any: ...
    def capabilities(self) -> dict: ...
    def call_log(self) -> list: ...


class GenerationGate:
    """Pause/abort/resume for generation calls running in other threads."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._cond = threading.Condition()
        self._paused = False
        self._active = 0
        self.abort = threading.Event()

    def enter(self, timeout: Optional[float] = None) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: not self._paused, timeout or self.timeout):
                raise SyncTimeout("the replica stayed paused (a weight sync is in progress)",
                                  phase="generate")
            self._active += 1

    def exit(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def pause(self, *, abort: bool = True, timeout: Optional[float] = None) -> None:
        with self._cond:
            self._paused = True
            if abort:
                self.abort.set()
            try:
                if not self._cond.wait_for(lambda: self._active == 0, timeout or self.timeout):
                    raise SyncTimeout(f"{self._active} generation(s) did not stop in time",
                                      phase="pause")
            finally:
                self.abort.clear()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def active(self) -> int:
        """Generation calls inside the gate now."""
        with self._cond:
            return self._active

    @property
    def paused(self) -> bool:
        return self._paused


class SyncFence:
    """When a replica may generate (the no-mixed-versions rule of the module doc): the one
    authority of an adapter, read through :attr:`blocked` (None: it may generate).

    Two things fence, and :attr:`blocked` gives the first that holds:

    * ``torn``: the replica's own weights are not one complete version (a load that wrote
      some of them failed). Set by an adapter that tells this apart from a failure that
      left the old weights intact (:meth:`tear`; the vLLM replica, from what its workers
      report); cleared by :meth:`applied`.
    * ``reason``: the sync protocol: from :meth:`begin` until every round of that version
      is done, from :meth:`start_round` until that round is done (adapters that fence on
      any failed round: the HF replica), from :meth:`fence` until a round completes a
      version. Without ``begin`` (a caller that syncs one round at a time) each successful
      round completes a version on its own.

    A *staged* sync (``begin(..., staged=True)``) receives into a copy, so its rounds
    fence nothing; :meth:`end_staged` ends it (committed: the new version is live, whole).
    """

    def __init__(self) -> None:
        self.reason: Optional[str] = None
        self.torn: Optional[str] = None
        self._pending: Optional[tuple[Any, set]] = None     # (version, kinds still to apply)
        self._staged = False                  # the pending version is received into a copy
        self._lock = threading.Lock()

    @property
    def blocked(self) -> Optional[str]:
        """Why the replica must not generate now; None when it holds one complete version."""
        return self.torn or self.reason

    def begin(self, version: Any, kinds: Sequence[str], *, staged: bool = False) -> None:
        bad = [k for k in kinds if k not in WEIGHT_KINDS]
        if bad or not kinds:
            raise ValueError(f"kinds must be a non-empty list of {WEIGHT_KINDS}, got {kinds!r}")
        with self._lock:
            self._pending, self._staged = (version, set(kinds)), bool(staged)
            if not staged:
                self.reason = f"the sync of version {version!r} is in progress"

    def _staged_of(self, version: Any) -> bool:
        return self._staged and self._pending is not None and self._pending[0] == version

    def start_round(self, version: Any, kind: str) -> None:
        with self._lock:
            if self._staged_of(version):
                return
            if self._pending is None or self._pending[0] != version:
                self._pending, self._staged = None, False
            self.reason = f"the sync of version {version!r} did not complete"

    def round_done(self, version: Any, kind: str) -> bool:
        """Record a fully applied round; True when ``version`` is now complete."""
        with self._lock:
            if self._staged_of(version):
                self._pending[1].discard(kind)        # type: ignore[index]
                return not self._pending[1]           # type: ignore[index]
            if self._pending is not None and self._pending[0] == version:
                self._pending[1].discard(kind)
                if self._pending[1]:
                    self.reason = (f"the sync of version {version!r} still lacks "
                                   f"{sorted(self._pending[1])}")
                    return False
            self._pending, self.reason = None, None
            return True

    def tear(self, reason: Optional[str]) -> None:
        """The replica's weights are (``reason``) or are again not (None) torn."""
        with self._lock:
            self.torn = None if reason is None else str(reason)

    def applied(self, version: Any, kind: str) -> bool:
        """A round was applied and committed: the weights are whole again; see round_done."""
        self.tear(None)
        return self.round_done(version, kind)

    def end_staged(self, *, committed: bool) -> None:
        """The staged sync is over; ``committed``: its version is now live and whole."""
        with self._lock:
            self._pending, self._staged = None, False
            if committed:
                self.reason = self.torn = None

    def fence(self, reason: str) -> None:
        with self._lock:
            self._pending, self._staged, self.reason = None, False, str(reason)


class ReplicaControls:
    """What every replica adapter shares: its call log (``_log``, a deque), pause/resume
    through its ``gate`` (a :class:`GenerationGate`), and the optional protocol calls on
    its ``_fence`` (a :class:`SyncFence`): ``begin_sync``, ``fence``, ``sync_state``."""

    _log: collections.deque
    gate: GenerationGate
    _fence: SyncFence
    current_version: Callable[[], Any]

    def _record(self, what: str) -> None:
        self._log.append(what)

    def call_log(self) -> list:
        return list(self._log)

    def clear_call_log(self) -> None:
        self._log.clear()

    def pause(self, *, abort: bool = True, timeout: Optional[float] = None) -> None:
        self._record("pause")
        self.gate.pause(abort=abort, timeout=timeout)

    def resume(self) -> None:
        self._record("resume")
        self.gate.resume()

    # -- no mixed versions ------------------------------------------------------------------
    def begin_sync(self, version: Any, kinds: Sequence[str]) -> None:
        """Fence generation until every round in ``kinds`` of ``version`` is applied."""
        self._fence.begin(version, list(kinds))

    def fence(self, reason: str) -> None:
        """Refuse to generate until a sync completes (e.g. a digest did not match)."""
        self._fence.fence(reason)

    def sync_state(self) -> dict:
        return {"version": self.current_version(), "fenced": self._fence.blocked}


class ReceiveStream:
    """The ``(name, tensor)`` stream of one receive, handed to ``load_weights``.

    It is the engine's ``receive_weights(version)``, unless the consumer says where the
    tensors go (``land_in(targets)``, before it iterates): then ``receive_into(targets,
    version)``, which lands the bytes in those tensors (no copy left to the consumer; a
    tensor that does not fit them comes as ``receive_weights`` would give it).

    Whoever hands it out closes it with the consumer's failure (``aclose(error)``): a
    stream the consumer never began makes the engine tell the group at once
    (``abort_receive``: the trainer ranks and every other peer end that sync instead of
    waiting out the timeout for this receiver), and one it left midway gets that failure
    thrown in, so the peers learn its text."""

    def __init__(self, engine: Any, version: Any, *,
                 open_: Optional[Callable[[Optional[dict]], Any]] = None,
                 abort_: Optional[Callable[[BaseException], None]] = None) -> None:
        """``open_(targets or None)``: the iterator to run, if not ``engine``'s own;
        ``abort_(error)``: how a stream never begun tells the group (default: the engine's
        ``abort_receive(error, version)``)."""
        self._open = open_ or (lambda into: engine.receive_weights(version) if into is None
                               else engine.receive_into(into, version))
        self._abort = abort_ or (lambda error: engine.abort_receive(error, version))
        self._into: Optional[dict] = None
        self._it: Any = None
        self._ended = False       # the iterator ran to its end, or the stream was closed

    @property
    def started(self) -> bool:
        """Whether the consumer began reading (the engine's receive runs or ran)."""
        return self._it is not None

    def land_in(self, targets: dict) -> None:
        if self._it is not None:
            raise RuntimeError("land_in after the stream started")
        self._into = targets

    def __aiter__(self) -> "ReceiveStream":
        return self

    async def __anext__(self) -> tuple:
        if self._ended:
            raise StopAsyncIteration
        if self._it is None:
            self._it = self._open(self._into)
        try:
            return await self._it.__anext__()
        except BaseException:
            self._ended = True    # ended (or failed) inside the engine: nothing to tell
            raise

    async def aclose(self, error: Optional[BaseException] = None) -> None:
        """End the stream; ``error``: why the consumer stopped (see the class doc). A
        stream never begun tells the group even without one: its sync cannot complete."""
        ended, self._ended = self._ended, True
        if self._it is None:
            if not ended:
                self._abort(error if error is not None else WeightSyncError(
                    "the consumer ended before it read the weights", phase="receive"))
            return
        if error is not None and not ended and isinstance(error, Exception):
            try:
                await self._it.athrow(error)   # the engine reports it to its peers
            except BaseException:  # noqa: BLE001 - that very error, raised by the caller
                pass
        await self._it.aclose()


class LocalEngineRollout(ReplicaControls, abc.ABC):
    """Base for adapters that receive in their own process with one checkpoint engine."""

    def __init__(self, *, name: str = "rollout", device: str = "cpu") -> None:
        self.name = name
        self.device = device
        self._engine: Any = None
        self._runner = AsyncRunner(f"weightsync-{name}")
        self._log: collections.deque = collections.deque(maxlen=2000)
        self._fence = SyncFence()
        self._in_flight = 0      # receives still running (maybe past a caller's timeout)

    def _check_idle(self, what: str) -> None:
        """Never release an engine whose buffers a running receive still reads from."""
        if self._in_flight:
            raise WeightSyncError(f"{self.name}: a receive is still running (hung past its "
                                  f"timeout?); cannot {what} its engine", phase=what)

    @property
    def _fenced(self) -> Optional[str]:
        """Why this replica must not generate now (None: it holds one complete version)."""
        return self._fence.blocked

    # -- engine lifecycle -----------------------------------------------------------------
    def engine_prepare(self, backend: str, engine_kwargs: dict) -> list:
        self._record("engine_prepare")
        old = self._engine
        if old is not None:
            self._check_idle("replace")
            old.finalize()
        kwargs = dict(engine_kwargs)
        kwargs.setdefault("device", self.device)
        self._engine = CheckpointEngineRegistry.new(backend, role="rollout", **kwargs)
        carry_codec_state(old, self._engine)    # delta bases outlive a rebuilt group
        return [self._engine.prepare()]

    def engine_init(self, kwargs_list: list) -> None:
        self._record("engine_init")
        if self._engine is None:
            raise RuntimeError(f"{self.name}: engine_init before engine_prepare")
        if len(kwargs_list) != 1:
            raise ValueError(f"{self.name} hosts 1 receiving rank, got {len(kwargs_list)} entries")
        self._engine.init_process_group(**kwargs_list[0])

    def engine_receive(self, version: Any, *, kind: str = "full",
                       adapter_config: Optional[dict] = None) -> dict:
        if self._engine is None:
            raise RuntimeError(f"{self.name}: engine_receive before engine_init")
        if kind not in WEIGHT_KINDS:
            raise ValueError(f"kind must be one of {WEIGHT_KINDS}, got {kind!r}")
        self._record(f"load:{kind}:{version}")
        start = time.perf_counter()
        self._fence.start_round(version, kind)     # fenced until the round is applied
        stats = self._runner.run(self._receive(version, kind, adapter_config),
                                 timeout=2 * self._engine.config.timeout + 30, phase="receive",
                                 version=version, peer=self.name)
        self._fence.round_done(version, kind)
        stats = dict(stats or {})
        stats.setdefault("seconds", time.perf_counter() - start)
        return stats

    async def _receive(self, version: Any, kind: str, adapter_config: Optional[dict]) -> dict:
        stream = ReceiveStream(self._engine, version)
        self._in_flight += 1
        failed: Optional[BaseException] = None
        try:
            out = await self.load_weights(stream, version=version, kind=kind,
                                          adapter_config=adapter_config)
            if not stream.started:
                raise WeightSyncError(f"{self.name}: load_weights returned without reading "
                                      "the weights", peer=self.name, phase="receive",
                                      version=version)
            return out
        except BaseException as exc:
            failed = exc
            raise
        finally:
            # If loading failed or stopped early, closing the stream now makes the engine
            # tell its peers at once, with the failure (not whenever it is collected, nor
            # at their timeout when it never began).
            try:
                await stream.aclose(failed)
            finally:
                self._in_flight -= 1

    def engine_finalize(self) -> None:
        self._record("engine_finalize")
        if self._engine is not None:
            self._check_idle("finalize")
            self._engine.finalize()
            self._engine = None

    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` of the hosted engine (coroutines run to completion, bounded)."""
        if self._engine is None:
            raise RuntimeError(f"{self.name}: no checkpoint engine (engine_prepare first)")
        return execute_on_engine(self._engine, method, args, kwargs, self._runner,
                                 peer=self.name)

    def close(self) -> None:
        self.engine_finalize()
        self._runner.close()

    # -- subclass hooks -------------------------------------------------------------------
    @abc.abstractmethod
    async def load_weights(self, weights: AsyncIterator, *, version: Any, kind: str,
                           adapter_config: Optional[dict]) -> dict:
        """Consume ``(name, tensor)`` pairs (views: copy before the next item)."""
