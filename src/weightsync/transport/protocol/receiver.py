"""Receiver half of the bucketed protocol (see :mod:`weightsync.transport.protocol.sender`)."""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping, Optional

import torch

from weightsync.core.errors import (IntegrityError, PeerFailed, PlanMismatch, SyncTimeout, VersionMismatch,
                      WeightSyncError)
from weightsync.core.plan import (Bucket, TensorMeta, bucket_digest, dtype_from_name, dtype_name,
                                  itemsize, plan_signature)
from weightsync.core.remote import error_msg, normalize_version, raise_remote
from weightsync.core.wire import DIRECT_SLOT, PUSHED_SLOT, AckMsg, BucketMsg, DoneMsg, ErrorMsg
from weightsync.transport.fastcopy import copy_into, memmove_from
from weightsync.transport.tensors import checksum, plain_cpu

__all__ = ["ReceiverMixin", "IntoProgram"]

logger = logging.getLogger(__name__)
_SLICE = 0.05          # how often a pump's wait looks at its sync's ``stop``
_REAP_S = 2.0          # how long a new receive waits for the pumps of the one before
_REPORT_GRACE_S = 0.5  # how long a receiver that lost its link looks for the trainer's report


class _Handoff:
    """Pump threads -> the consumer's event loop: no executor thread waits for an item."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._q = loop, asyncio.Queue()

    def put(self, item: tuple) -> None:       # any thread
        try:
            self._loop.call_soon_threadsafe(self._q.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: its receive is over
            pass

    async def get(self, timeout: float) -> tuple:
        return await asyncio.wait_for(self._q.get(), timeout)


class Abandoned(WeightSyncError):
    """Raised in a pump whose sync ended (failed, or left by its consumer)."""


@dataclass
class _RecvState:
    seq: int
    version: Any
    q: _Handoff
    remaining: set
    seen: set = field(default_factory=set)
    partial: dict = field(default_factory=dict)      # name -> (stream, staging tensor)
    tensors: int = 0
    nbytes: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    into: Optional[Mapping[str, torch.Tensor]] = None
    # one direct tensor staged at a time: the pump reads the next one only once the
    # consumer moved past the last (extra memory <= the ring + one tensor)
    staged: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(1))


class _SemEvent:
    """A semaphore seen as an event: ``wait`` acquires it."""

    def __init__(self, sem: threading.Semaphore) -> None:
        self._sem = sem

    def wait(self, timeout: float) -> bool:
        return self._sem.acquire(timeout=timeout)


class IntoProgram:
    """A replayed bucket's copies into the caller's tensors (``receive_into``), worked out
    once: the names, where each lies in the bucket, and where each destination's memory
    is. It is used again while the bucket's layout and memory are the same and each name
    maps to a tensor over the same memory (address, shape, dtype): the very objects, or new
    views of them, as a replica's ``detach()`` of its parameters yields every sync. A
    program keeps no reference to the caller's tensors. The backend's ``runner`` issues
    the copies (on a GPU: a captured CUDA graph from the second use on, see
    :meth:`ReceiverMixin._rx_copy_runner`)."""

    __slots__ = ("layout", "src", "names", "spans", "where", "nbytes", "runner", "runs")

    def __init__(self, layout: str, src: Any, names: tuple, spans: tuple, dests: list,
                 runner: Any) -> None:
        self.layout, self.src, self.names, self.spans = layout, src, names, spans
        self.where = tuple((d.data_ptr(), d.shape, d.dtype, d.device) for d in dests)
        self.nbytes = sum(n for _, n in spans)
        self.runner = runner
        self.runs = 0

    def dests_in(self, into: Mapping[str, torch.Tensor]) -> Optional[list]:
        """The destinations if ``into`` still maps every name to a contiguous tensor over
        the same memory."""
        dests = [into.get(n) for n in self.names]
        for d, (ptr, shape, dtype, device) in zip(dests, self.where):
            if d is None or d.data_ptr() != ptr or d.shape != shape or d.dtype != dtype \
                    or d.device != device or not d.is_contiguous():
                return None
        return dests


def _fits(dest: Optional[torch.Tensor], shape: tuple, dtype: torch.dtype, device: Any) -> bool:
    return (dest is not None and dest.dtype == dtype and tuple(dest.shape) == tuple(shape)
            and dest.device == device and dest.is_contiguous())


def patience(timeout: float) -> float:
    """How long a receiver waits for a sender: longer than the sender waits for receivers
    (``timeout``), so that when one receiver stalls the sender reports it first and the
    others hear who failed instead of timing out on a healthy sender themselves."""
    return timeout + max(1.0, 0.1 * timeout)


class ReceiverMixin:
    """``receive_weights`` for :class:`BucketedEngine` subclasses."""

    #: Whether buckets received ``into`` the caller's tensors replay an
    #: :class:`IntoProgram` (backends whose copies are queued on a device stream, where
    #: per-tensor host work sets the pace; CPU backends land bytes their own way).
    _rx_programs = False

    def receive_into(self, params: Mapping[str, torch.Tensor], version: Any = None
                     ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Receive one version straight into preallocated tensors.

        ``params`` maps names to the receiver's own tensors (e.g. its model's). Each
        received tensor whose name is there with the same dtype, shape and device (and
        contiguous) is written into it by the engine, then yielded as ``(name, params[name])``
        -- no copy is left to the caller, and tensors bigger than a bucket are assembled in
        place. Other names are yielded as by :meth:`receive_weights`.
        """
        return self.receive_weights(version, into=params)

    async def receive_weights(self, version: Any = None, *,
                              into: Optional[Mapping[str, torch.Tensor]] = None
                              ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        version = normalize_version(version)  # as the sender's, whatever int type it is
        if self.config.role != "rollout" or self._rank < 0:
            raise RuntimeError(f"{self.backend_name}: receive_weights needs a rollout engine "
                               "after init_process_group")
        if into is not None and not isinstance(into, Mapping):
            raise ValueError(f"into must be a mapping of name -> tensor, got {type(into).__name__}")
        self._seq += 1
        state = _RecvState(self._seq, version, _Handoff(asyncio.get_running_loop()),
                           set(range(self._world)), into=into)
        start = time.perf_counter()
        try:
            await self._reap_pumps(state)
            self._check_usable(state.version)
            self._rx_begin(state)
            self._rx_state = state
            pumps = [threading.Thread(target=self._pump, args=(s, state), daemon=True,
                                      name=f"weightsync-rx{self._rank}-s{s}")
                     for s in range(self._world)]
            self._rx_pumps = pumps
            for t in pumps:
                t.start()
            while state.remaining:
                item = await self._next_item(state)
                async for pair in self._handle(state, item):
                    yield pair
        except BaseException as exc:
            reported = await self._reported_failure(state, exc)
            self._abort_receive(state, reported or exc)
            if reported is not None:
                raise reported from exc
            raise
        finally:
            state.stop.set()   # every pump wait looks at it; the next receive reaps them
        # every stream delivered its Done: each pump has returned or is returning right now,
        # so the receive ends with no thread of its own left behind
        for t in pumps:
            t.join(timeout=_REAP_S)
        seconds = time.perf_counter() - start
        logger.info("weightsync %s: rollout rank %d received version %s: %d tensors, %d bytes "
                    "in %.4f s (%.2f GB/s)", self.backend_name, self._rank, version,
                    state.tensors, state.nbytes, seconds,
                    state.nbytes / seconds / 1e9 if seconds > 0 else 0.0)

    async def _reported_failure(self, state: _RecvState,
                                exc: BaseException) -> Optional[PeerFailed]:
        """A trainer that ends a sync (a peer failed) reports why, then closes its links; a
        receiver whose ack finds the link closed first raises that report, which names the
        failure, once its pump has it (waited for briefly), rather than the closed link."""
        if not (isinstance(exc, PeerFailed) and exc.origin is None
                and str(exc.peer or "").startswith("trainer rank")):
            return None
        deadline = time.monotonic() + _REPORT_GRACE_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                kind, _, msg, _ = await state.q.get(left)
            except asyncio.TimeoutError:
                return None
            if kind == "exc":
                return None
            if isinstance(msg, ErrorMsg):
                try:
                    raise_remote(msg, phase="receive")
                except PeerFailed as err:
                    return err
        return None

    async def _reap_pumps(self, state: _RecvState) -> None:
        """The pumps of the previous receive have ended (they stop within ``_SLICE`` once
        their sync is over); one still reading after ``_REAP_S`` fails this sync at once,
        before any new pump could share its link."""
        deadline = time.monotonic() + _REAP_S
        old = getattr(self, "_rx_pumps", [])
        while any(t.is_alive() for t in old) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if any(t.is_alive() for t in old):
            raise WeightSyncError("a pump of the previous receive is still reading its "
                                  "trainer; re-initialize the engine",
                                  peer=f"rollout rank {self._rank}", phase="receive",
                                  version=state.version)
        self._rx_pumps = []

    def _rx_over(self) -> bool:
        """The current receive is over (a pump or backend wait should end now)."""
        state = getattr(self, "_rx_state", None)
        return state is not None and state.stop.is_set()

    def _rx_wait(self, event: threading.Event, timeout: float, *, what: str,
                 version: Any) -> None:
        """Pump thread: wait for ``event`` (this receiver's consumer releasing something),
        at most ``timeout``, ending at once when the sync is over."""
        deadline = time.monotonic() + timeout
        while not event.wait(_SLICE):
            if self._rx_over():
                raise Abandoned("the receive ended", phase="receive", version=version)
            if time.monotonic() > deadline:
                raise SyncTimeout(f"the consumer did not release {what} in {timeout:.1f}s",
                                  peer=f"rollout rank {self._rank}", phase="receive",
                                  version=version)

    async def _next_item(self, state: _RecvState) -> tuple:
        try:
            return await state.q.get(patience(self.config.timeout) + 5)
        except asyncio.TimeoutError:
            raise SyncTimeout("receive pump stalled", peer=f"trainer ranks {sorted(state.remaining)}",
                              phase="receive", version=state.version) from None

    def _pump(self, stream: int, state: _RecvState) -> None:
        """Thread: pop this stream's messages, fetch bucket bytes, hand them to the consumer.

        With ``_rx_ahead`` > 1 (a backend whose fetches are posted, then waited for) the
        next message's fetch is posted while earlier ones are still in flight, up to that
        many at once, when its header is already here and it needs no wait of its own (a
        direct tensor into the caller's tensor, a bucket whose slot is free); they
        complete, and reach the consumer, in the order they came."""
        inbox = self._rx_pump_inbox(stream)
        peer = f"trainer rank {stream}"
        ahead: collections.deque = collections.deque()   # posted, not completed: oldest first
        try:
            while not state.stop.is_set():
                msg = self._pump_next(inbox, ahead, stream, state, peer)
                if msg is None:
                    continue
                seq = getattr(msg, "seq", state.seq)
                if seq < state.seq:
                    continue  # left over from an earlier, failed sync
                if seq > state.seq:
                    raise PlanMismatch(f"out of step: this receiver is at sync {state.seq}, "
                                       f"the sender at sync {seq}; re-initialize the group",
                                       peer=peer, phase="receive", version=state.version)
                if isinstance(msg, BucketMsg):
                    self._check_version(state, msg.version, peer)
                    if msg.slot not in (PUSHED_SLOT, DIRECT_SLOT) and self._rx_ahead > 1:
                        while len(ahead) >= self._rx_ahead:
                            self._pump_complete(ahead, stream, state)
                        posted = self._rx_fetch_post(stream, msg)
                        if posted is not None:
                            ahead.append(("bucket", msg, posted[0], posted[1]))
                            continue
                    if msg.slot == DIRECT_SLOT:
                        self._pump_direct(ahead, stream, msg, state, inbox)
                        continue
                    self._pump_flush(ahead, stream, state)
                    if msg.slot == PUSHED_SLOT:   # the bytes are in our tensors already
                        state.q.put(("pushed", stream, msg, None))
                        continue
                    state.q.put(("bucket", stream, msg, self._rx_fetch(stream, msg)))
                    continue
                self._pump_flush(ahead, stream, state)
                state.q.put(("msg", stream, msg, None))
                if isinstance(msg, (DoneMsg, ErrorMsg)):
                    return
        except BaseException as exc:  # handed to the consumer, which raises it
            state.q.put(("exc", stream, exc, None))

    def _pump_next(self, inbox: Any, ahead: Any, stream: int, state: _RecvState,
                   peer: str) -> Any:
        """The next message; while fetches are in flight, only one already here (else the
        oldest fetch is completed and None returned)."""
        if not ahead:
            return inbox.pop(timeout=patience(self.config.timeout), peer=peer,
                             phase="receive", version=state.version)
        try:
            return inbox.pop(timeout=0.0, peer=peer, phase="receive", version=state.version)
        except SyncTimeout:
            self._pump_complete(ahead, stream, state)
            return None

    def _pump_complete(self, ahead: Any, stream: int, state: _RecvState) -> None:
        """Wait for the oldest fetch in flight and hand it to the consumer."""
        kind, msg, out, handle = ahead.popleft()
        self._rx_complete(stream, msg, handle)
        if kind == "direct":
            self._rx_direct_ack(stream, msg, state)
        state.q.put((kind, stream, msg, out))

    def _pump_flush(self, ahead: Any, stream: int, state: _RecvState) -> None:
        while ahead:
            self._pump_complete(ahead, stream, state)

    def _pump_direct(self, ahead: Any, stream: int, msg: BucketMsg, state: _RecvState,
                     inbox: Any) -> None:
        """Fetch a tensor sent outside the buckets: posted ahead when it lands in the
        caller's tensor, else after every fetch in flight (its staging waits for the
        consumer)."""
        dest = self._rx_direct_dest(stream, msg, state)
        if dest is None or self._rx_ahead < 2:
            self._pump_flush(ahead, stream, state)
            state.q.put(("direct", stream, msg,
                         self._rx_direct_pump(stream, msg, state, inbox, dest)))
            return
        while len(ahead) >= self._rx_ahead:
            self._pump_complete(ahead, stream, state)
        handle = self._rx_direct_post(stream, msg, getattr(inbox, "last_aux", 0), dest)
        ahead.append(("direct", msg, dest, handle))

    def _rx_begin(self, state: _RecvState) -> None:
        """Hook, at the start of every receive, before any pump reads (e.g. tell the
        trainers where they may write this receiver's tensors: ``state.into``)."""

    def _rx_direct_dest(self, stream: int, msg: BucketMsg, state: _RecvState
                        ) -> Optional[torch.Tensor]:
        """Check a direct tensor's header; the caller's tensor it lands in, if one fits."""
        peer = f"trainer rank {stream}"
        if not msg.entries or len(msg.entries) != 1:
            raise PlanMismatch("a direct tensor needs exactly one entry", peer=peer,
                               phase="receive", version=msg.version)
        meta = msg.entries[0]
        dtype = dtype_from_name(meta.dtype)
        if meta.is_chunk or meta.offset or \
                meta.nbytes != math.prod(meta.shape) * itemsize(meta.dtype):
            raise PlanMismatch(f"direct tensor {meta.name!r} has an inconsistent size",
                               peer=peer, phase="receive", version=msg.version)
        dest = state.into.get(meta.name) if state.into is not None else None
        return dest if _fits(dest, meta.shape, dtype, torch.device(self.config.device)) else None

    def _rx_direct_pump(self, stream: int, msg: BucketMsg, state: _RecvState,
                        inbox: Any, dest: Optional[torch.Tensor]) -> torch.Tensor:
        """Pump thread: fetch a tensor sent outside the buckets, then acknowledge it (the
        sender waits for that before it moves on). Into ``dest`` (the caller's tensor, from
        :meth:`_rx_direct_dest`), else into a staging buffer."""
        if dest is None:
            meta = msg.entries[0]
            self._rx_wait(_SemEvent(state.staged), self.config.timeout,
                          what="the last direct tensor", version=msg.version)
            dest = self._staging(meta.nbytes, torch.device(self.config.device)).view(
                dtype_from_name(meta.dtype)).view(meta.shape)
        self._rx_direct(stream, msg, getattr(inbox, "last_aux", 0), dest)
        self._rx_direct_ack(stream, msg, state)
        return dest

    def _rx_direct_ack(self, stream: int, msg: BucketMsg, state: _RecvState) -> None:
        self._rx_control(stream).push("t", AckMsg(seq=state.seq, stream=stream,
                                                  rank=self._rank, index=msg.index))

    def _staging(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A byte buffer for a direct tensor that has no destination: reused across
        tensors and syncs (fresh pages cost more than the copy), at most a bucket kept."""
        pool = self.__dict__.setdefault("_staging_pool", {})
        with self.__dict__.setdefault("_staging_lock", threading.Lock()):
            free = pool.get((nbytes, device))
            if free:
                return free.pop()
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)[:nbytes]

    def _unstage(self, buf: torch.Tensor) -> None:
        """The consumer moved past a direct tensor in a staging buffer: keep it for reuse."""
        flat = buf.reshape(-1).view(torch.uint8) if buf.dim() else buf.reshape(1).view(torch.uint8)
        pool = self.__dict__.setdefault("_staging_pool", {})
        with self.__dict__.setdefault("_staging_lock", threading.Lock()):
            kept = sum(t.numel() for ts in pool.values() for t in ts)
            if kept + flat.numel() <= self.config.bucket_size:
                pool.setdefault((flat.numel(), flat.device), []).append(flat)

    def _rx_direct(self, stream: int, msg: BucketMsg, aux: int, dest: torch.Tensor) -> None:
        """Hook: fill ``dest`` with the direct tensor described by ``msg``."""
        raise PlanMismatch("this backend does not take direct tensors",
                           peer=f"trainer rank {stream}", phase="receive", version=msg.version)

    # -- fetches posted ahead (backends with ``_rx_ahead`` > 1) ------------------------------
    #: How many fetches a pump may have in flight at once (1: each completes before the next
    #: message is read). A backend that sets more implements the three hooks below.
    _rx_ahead = 1

    def _rx_direct_post(self, stream: int, msg: BucketMsg, aux: int, dest: torch.Tensor) -> Any:
        """Hook: start filling ``dest`` (as :meth:`_rx_direct`); a handle for
        :meth:`_rx_complete`."""
        raise NotImplementedError

    def _rx_fetch_post(self, stream: int, msg: BucketMsg) -> Optional[tuple[torch.Tensor, Any]]:
        """Hook: start fetching a bucket if that needs no wait now (its slot is free):
        ``(buffer, handle)``; None: fetch it with :meth:`_rx_fetch` once every fetch in
        flight completed."""
        return None

    def _rx_complete(self, stream: int, msg: BucketMsg, handle: Any) -> None:
        """Hook: wait (bounded) until a posted fetch completed; raise its failure."""
        raise NotImplementedError

    def _check_version(self, state: _RecvState, got: Any, peer: str) -> None:
        if state.version is not None and state.version != got:
            raise VersionMismatch(f"expected weights of version {state.version!r}, "
                                  f"{peer} sends version {got!r}", peer=peer,
                                  phase="receive", version=got)

    async def _handle(self, state: _RecvState, item: tuple) -> AsyncIterator[tuple[str, torch.Tensor]]:
        kind, stream, msg, buf = item
        if kind == "exc":
            raise msg
        if isinstance(msg, ErrorMsg):
            raise_remote(msg, phase="receive")
        if isinstance(msg, DoneMsg):
            self._rx_finish_stream(state, stream, msg)
            return
        if kind == "pushed":
            for name, dest in self._rx_pushed(state, stream, msg):
                yield name, dest
            return
        if kind == "direct":
            meta = msg.entries[0]
            if meta.name not in state.seen and meta.name not in state.partial:
                state.seen.add(meta.name)
                state.tensors += 1
                state.nbytes += meta.nbytes
                yield meta.name, buf
            if state.into is None or state.into.get(meta.name) is not buf:
                self._unstage(buf)
                state.staged.release()
            return
        entries = self._layout(stream, msg)
        if self.config.checksum and msg.checksum is not None:
            if checksum(buf[: msg.nbytes]) != msg.checksum:
                raise IntegrityError(f"bucket {msg.index} failed its checksum",
                                     peer=f"trainer rank {stream}", phase="receive",
                                     version=msg.version)
        found = self._rx_program(state, stream, msg, entries, buf)
        if found is not None:
            prog, dests = found
            prog.runner(lambda: self._rx_program_pairs(prog, dests, buf))
            prog.runs += 1
            state.seen.update(prog.names)
            state.tensors += len(dests)
            state.nbytes += prog.nbytes
            for name, dest in zip(prog.names, dests):
                yield name, dest
        else:
            for meta in entries:
                out = self._take(state, stream, meta, buf)
                if out is not None:
                    yield out
        self._rx_release(stream, msg)
        self._rx_control(stream).push("t", AckMsg(seq=state.seq, stream=stream,
                                                  rank=self._rank, index=msg.index))

    def _rx_pushed(self, state: _RecvState, stream: int, msg: BucketMsg) -> list:
        """The tensors a trainer wrote straight into ``state.into`` (a ``PUSHED_SLOT``
        message): each must be one we offered, whole, exactly as it is."""
        peer, out = f"trainer rank {stream}", []
        for meta in msg.entries or ():
            dest = state.into.get(meta.name) if state.into is not None else None
            if dest is None or meta.is_chunk or tuple(dest.shape) != meta.shape or \
                    dtype_name(dest.dtype) != meta.dtype:
                raise PlanMismatch(f"tensor {meta.name!r} was written into memory this "
                                   "receiver did not offer", peer=peer, phase="receive",
                                   version=msg.version)
            if meta.name in state.seen:
                continue
            state.seen.add(meta.name)
            state.tensors += 1
            state.nbytes += meta.nbytes
            out.append((meta.name, dest))
        return out

    # -- replayed copies into the caller's tensors -------------------------------------------
    def _rx_program(self, state: _RecvState, stream: int, msg: BucketMsg,
                    entries: tuple[TensorMeta, ...], buf: Any) -> Optional[tuple]:
        """``(program, destinations)`` when this bucket lands whole in ``into``: the last
        sync's program if layout, bucket memory and destinations are the same, else a new
        one (or None: a chunk, a name already delivered, a destination that does not fit)."""
        if state.into is None or not self._rx_programs:
            return None
        progs = self.__dict__.setdefault("_rx_progs", {})
        key = (stream, msg.index, msg.slot)
        src = self._rx_src_key(buf, entries)
        prog = progs.get(key)
        if prog is not None and prog.layout == msg.layout and prog.src == src:
            dests = prog.dests_in(state.into)
            if dests is not None and state.seen.isdisjoint(prog.names) \
                    and state.partial.keys().isdisjoint(prog.names):
                return prog, dests
        progs.pop(key, None)
        names, spans, dests = [], [], []
        for meta in entries:
            dest = state.into.get(meta.name)
            if meta.is_chunk or meta.total_nbytes == 0 or meta.name in state.seen \
                    or meta.name in state.partial \
                    or not _fits(dest, meta.shape, dtype_from_name(meta.dtype), buf.device):
                return None
            names.append(meta.name)
            spans.append((meta.offset, meta.nbytes))
            dests.append(dest)
        if len(set(names)) != len(names):
            return None
        prog = progs[key] = IntoProgram(msg.layout, src, tuple(names), tuple(spans), dests,
                                        self._rx_copy_runner())
        return prog, dests

    @staticmethod
    def _rx_program_pairs(prog: IntoProgram, dests: list, buf: Any) -> list:
        """The program's ``(destination bytes, bucket bytes)`` pairs, for this sync."""
        return [(d.view(-1).view(torch.uint8) if d.dim() else d.reshape(1).view(torch.uint8),
                 buf[off: off + n]) for d, (off, n) in zip(dests, prog.spans)]

    def _rx_src_key(self, buf: Any, entries: tuple[TensorMeta, ...]) -> Any:
        """Hook: what identifies the memory a bucket's ``entries`` are read from (a program
        is replayed only over the same memory)."""
        return (buf.data_ptr(), buf.numel())

    def _rx_copy_runner(self) -> Any:
        """Hook of backends that set ``_rx_programs``: a callable that issues a program's
        copies, given a function returning its ``(destination, source)`` pairs."""
        raise NotImplementedError

    #: Bucket indexes from here on are not the stream's numbered buckets (a backend's own
    #: batches, e.g. cuda_ipc's zero-copy ones); None: all are.
    _rx_bucket_index_end: Optional[int] = None

    def _rx_drop_programs(self, stream: int, *, min_index: int = 0,
                          end_index: Optional[int] = None) -> None:
        """Forget the programs of ``stream`` for buckets ``min_index`` to ``end_index``
        (excluded; None: all from ``min_index``), e.g. when the memory they read changed,
        or the stream sends fewer buckets now."""
        progs = self.__dict__.get("_rx_progs")
        if progs:
            for key in [k for k in progs if k[0] == stream and k[1] >= min_index
                        and (end_index is None or k[1] < end_index)]:
                del progs[key]

    def _layout(self, stream: int, msg: BucketMsg) -> tuple[TensorMeta, ...]:
        plan = self._rx_plans.setdefault(stream, [])
        if msg.entries is None:
            if msg.index >= len(plan) or bucket_digest(plan[msg.index]) != msg.layout:
                raise PlanMismatch(f"bucket {msg.index} replays a layout this receiver does "
                                   "not hold (it joined late or missed a sync); re-initialize",
                                   peer=f"trainer rank {stream}", phase="receive",
                                   version=msg.version)
            return plan[msg.index].entries
        limit = self.config.bucket_size
        for e in msg.entries:
            if e.offset + e.nbytes > min(limit, msg.nbytes) or e.chunk_offset + e.nbytes > e.total_nbytes:
                raise PlanMismatch(f"entry {e.name!r} lies outside bucket {msg.index}",
                                   peer=f"trainer rank {stream}", phase="receive",
                                   version=msg.version)
        bucket = Bucket(msg.index, msg.nbytes, msg.entries)
        if bucket_digest(bucket) != msg.layout:
            raise PlanMismatch(f"layout of bucket {msg.index} does not match its digest",
                               peer=f"trainer rank {stream}", phase="receive",
                               version=msg.version)
        if msg.index < len(plan):
            plan[msg.index] = bucket
        elif msg.index == len(plan):
            plan.append(bucket)
        else:
            raise PlanMismatch(f"bucket {msg.index} arrived before bucket {len(plan)}",
                               peer=f"trainer rank {stream}", phase="receive",
                               version=msg.version)
        return msg.entries

    def _take(self, state: _RecvState, stream: int, meta: TensorMeta,
              buf: torch.Tensor) -> Optional[tuple[str, torch.Tensor]]:
        """The tensor completed by this piece (a view for whole tensors), else None."""
        dtype = dtype_from_name(meta.dtype)
        if meta.chunk_offset == 0:
            if meta.name in state.seen or meta.name in state.partial:
                return None  # a duplicate from another trainer rank
            dest = state.into.get(meta.name) if state.into is not None else None
            if not _fits(dest, meta.shape, dtype, buf.device):
                dest = None
            if meta.total_nbytes == 0:
                state.seen.add(meta.name)
                if dest is not None:
                    return meta.name, dest
                return meta.name, torch.empty(meta.shape, dtype=dtype, device=buf.device)
            if not meta.is_chunk:
                state.seen.add(meta.name)
                state.tensors += 1
                state.nbytes += meta.nbytes
                if dest is not None and buf.device.type == "cpu" and plain_cpu(dest):
                    self._land(dest, buf, meta.offset, meta.nbytes)  # no views made
                    return meta.name, dest
                view = buf[meta.offset: meta.offset + meta.nbytes]
                if dest is not None:
                    copy_into(dest.view(-1).view(torch.uint8) if dest.dim() else
                              dest.reshape(1).view(torch.uint8), view)
                    return meta.name, dest
                return meta.name, view.view(dtype).view(meta.shape)
            staging = dest if dest is not None else self._staging_for(meta, dtype, buf.device)
            state.partial[meta.name] = (stream, staging)
        owner, staging = state.partial.get(meta.name, (None, None))
        if owner != stream:
            return None
        flat = staging.view(-1).view(torch.uint8)
        piece = flat[meta.chunk_offset: meta.chunk_offset + meta.nbytes]
        if buf.device.type == "cpu" and plain_cpu(staging) and isinstance(buf, torch.Tensor):
            self._land(piece, buf, meta.offset, meta.nbytes)
        else:
            copy_into(piece, buf[meta.offset: meta.offset + meta.nbytes])
        if not meta.is_last_chunk:
            return None
        del state.partial[meta.name]
        state.seen.add(meta.name)
        state.tensors += 1
        state.nbytes += meta.total_nbytes
        return meta.name, staging

    def _staging_for(self, meta: TensorMeta, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
        """Where a tensor bigger than a bucket is assembled when the caller gave none: the
        same buffer as last sync's for this name (kept between syncs, as the buckets are),
        so no sync pays for fresh memory (page faults on a CPU receiver: an embedding of
        1 GB each time). Yielded, it is valid until the next sync, as bucket views are until
        the next tensor."""
        cache = self.__dict__.setdefault("_rx_staging", {})
        t = cache.get(meta.name)
        if t is None or tuple(t.shape) != tuple(meta.shape) or t.dtype != dtype \
                or t.device != device:
            cache[meta.name] = t = torch.empty(meta.shape, dtype=dtype, device=device)
        return t

    def _land(self, dest: torch.Tensor, buf: torch.Tensor, offset: int, nbytes: int) -> None:
        """Hook: ``nbytes`` at ``offset`` of a CPU bucket into the caller's CPU tensor."""
        memmove_from(dest, buf, offset, nbytes)

    def _rx_finish_stream(self, state: _RecvState, stream: int, msg: DoneMsg) -> None:
        peer = f"trainer rank {stream}"
        self._check_version(state, msg.version, peer)
        plan = self._rx_plans.setdefault(stream, [])
        del plan[msg.num_buckets:]
        if len(plan) != msg.num_buckets or \
                plan_signature(self.config.bucket_size, plan) != msg.signature:
            self._rx_plans.pop(stream, None)
            raise PlanMismatch("the replayed layout does not match the sender's plan "
                               "signature", peer=peer, phase="receive", version=msg.version)
        # a layout that shrank: the programs of the buckets past its end go
        self._rx_drop_programs(stream, min_index=msg.num_buckets,
                               end_index=self._rx_bucket_index_end)
        state.remaining.discard(stream)
        if not state.remaining and state.partial:
            raise PlanMismatch(f"tensors left incomplete: {sorted(state.partial)[:10]}",
                               peer=peer, phase="receive", version=msg.version)
        self._rx_control(stream).push("t", AckMsg(seq=state.seq, stream=stream,
                                                  rank=self._rank, index=0, final=True))

    def _abort_unread(self, error: BaseException, version: Any) -> None:
        """:meth:`abort_receive`: the error of the sync this receiver skips, pushed to every
        trainer rank on the channel that carries its acks (each fails at its next look at
        it, as on a failure mid-receive)."""
        if self.config.role != "rollout" or self._rank < 0:
            raise RuntimeError(f"{self.backend_name}: abort_receive needs a rollout engine "
                               "after init_process_group")
        self._seq += 1
        msg = error_msg(error, seq=self._seq, version=version,
                        peer=f"rollout rank {self._rank}", phase="receive")
        for stream in range(self._world):
            try:
                self._rx_control(stream).push("t", msg)
            except Exception:  # that trainer rank is gone; tell the others
                logger.debug("could not report the failure to stream %d", stream, exc_info=True)

    def _abort_receive(self, state: _RecvState, exc: BaseException) -> None:
        """Tell every sender (which relays to the other receivers) that this sync failed."""
        if isinstance(exc, GeneratorExit):
            exc = WeightSyncError("the consumer stopped iterating before the end")
        msg = error_msg(exc, seq=state.seq, version=state.version,
                        peer=f"rollout rank {self._rank}", phase="receive")
        for stream in range(self._world):
            try:
                self._rx_control(stream).push("t", msg)
                self._rx_control(stream).push(f"r{self._rank}", msg)  # wakes our own pump
            except Exception:
                logger.debug("could not report the failure to stream %d", stream, exc_info=True)
