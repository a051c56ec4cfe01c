"""The bucketed sync protocol shared by the ``shm`` and ``collective`` backends.

Each trainer rank is one *stream*: it packs the tensors it owns into buckets (see
:mod:`weightsync.core.plan`), cycling through ``num_slots`` buffers, and publishes each bucket
with a small header (:class:`~weightsync.core.wire.BucketMsg`) through the control channel.
The header carries the bucket's layout only when it differs from the layout cached from
the previous sync, so a repeated sync sends no per-tensor metadata at all. Receivers pump
every stream in a thread, expose each bucket's tensors as views, and release the bucket
once the consumer has moved past it. A subclass supplies the data path: where slot
buffers live and how bucket bytes reach receivers. Tensors big enough may skip the buckets
("direct"): :class:`DirectTensors` holds what the backends that do this share.

Subclassed by the bucketed backends of :mod:`weightsync.transport.backends` (``shm``,
``collective``, ``cuda_ipc``), with :class:`~.receiver.ReceiverMixin` for the other half.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from weightsync.core.errors import PeerFailed, PlanMismatch, SyncTimeout, WeightSyncError
from weightsync.core.plan import (Bucket, PlanBuilder, Replay, ReplayBuilder, TensorMeta, bucket_digest,
                                  dtype_name, plan_signature)
from weightsync.core.remote import error_msg, normalize_version, raise_remote, wire_version
from weightsync.core.wire import (DIRECT_BASE, DIRECT_SLOT, AckMsg, BucketMsg, DoneMsg, ErrorMsg,
                                  LandMsg)
from weightsync.transport.fastcopy import can_memmove, copy_into, memmove_at
from weightsync.transport.tensors import (LastingStorage, aiter_items, as_bytes, checksum, plain_cpu,
                                         wire_dtype)
from weightsync.transport.protocol.ownership import Ownership
from weightsync.transport.base import CheckpointEngine

__all__ = ["BucketedEngine", "DirectTensors", "DIRECT_WINDOW", "chunk_source", "direct_header",
           "plain_cpu"]

logger = logging.getLogger(__name__)


def _best_effort(tell: Any) -> None:
    try:
        tell()
    except Exception:  # the control channel itself may be gone
        logger.debug("could not tell peers about a failed sync", exc_info=True)


@dataclass
class _SendState:
    seq: int
    version: Any
    builder: Any                 # PlanBuilder or ReplayBuilder
    open_slot: Optional[int] = None
    published: int = 0
    tensors: int = 0
    nbytes: int = 0
    changed: int = 0
    yielded: list = field(default_factory=list)
    lasting: set = field(default_factory=set)    # names whose bytes outlive their item
    direct_pending: Any = field(default_factory=collections.deque)  # direct indices unacked
    direct_unwaited: int = 0     # direct tensors moved on from before receivers read them


def direct_header(engine: Any, state: Any, name: str, tensor: torch.Tensor,
                  dtype: torch.dtype) -> BucketMsg:
    """Header of a tensor that goes "direct" (outside the bucket ring): the k-th of sync
    ``state.seq``, indexed from ``DIRECT_BASE`` so it never collides with bucket indices."""
    seq, k = engine._direct_seq
    k = k + 1 if seq == state.seq else 1
    engine._direct_seq = (state.seq, k)
    nbytes = tensor.numel() * tensor.element_size()
    meta = TensorMeta(name, tuple(tensor.shape), dtype_name(dtype), 0, nbytes, 0, nbytes)
    return BucketMsg(version=wire_version(state.version), seq=state.seq, stream=engine._rank,
                     index=DIRECT_BASE + k, slot=DIRECT_SLOT, nbytes=nbytes,
                     layout="direct", entries=(meta,))


def chunk_source(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as the bytes its chunks are cut from: in the wire dtype, contiguous (the
    same object when it already is both)."""
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor.contiguous()


#: Direct tensors whose bytes outlive their item that a sender of ``shm`` or ``collective``
#: may leave unread: receivers read one while the trainer asks its iterator for the next.
DIRECT_WINDOW = 2


class DirectTensors:
    """The half of the direct-tensor hooks that ``shm`` and ``collective`` share; mix it in
    before :class:`BucketedEngine`. A tensor goes direct when the backend allows it now
    (``_direct_on``), it is a plain CPU tensor already in the wire dtype, and it has at
    least ``_direct_min`` bytes; its header (:func:`direct_header`) and the send's counts
    are done here, the bytes by the backend's ``_direct_deliver`` (and ``_rx_direct``
    on the receiving side)."""

    _direct_min: int = 0
    _direct_seq: tuple = (0, 0)        # (seq, k): the k-th direct tensor of sync seq
    #: direct tensors a sender may leave unacknowledged (1: each is read before the next
    #: item is asked for); more only for tensors whose bytes outlive their item
    #: (:class:`~weightsync.transport.tensors.LastingStorage`, which sees every tensor
    #: that may go direct, and every plain CPU tensor once one may be in flight)
    _direct_window: int = 1

    def _lasting_tracker(self) -> LastingStorage:
        tracker = self.__dict__.get("_lasting")
        if tracker is None:
            tracker = self.__dict__["_lasting"] = LastingStorage(min_bytes=max(self._direct_min, 1))
        return tracker

    async def send_weights(self, named_tensors: Any, version: Any = None) -> dict[str, Any]:
        if self._direct_window < 2:
            return await super().send_weights(named_tensors, version)
        tracker = self._lasting_tracker()
        tracker.begin()
        try:
            report = await super().send_weights(named_tensors, version)
        except BaseException:
            tracker.reset()         # a failed sync: trust no storage from before it
            raise
        tracker.finish()
        return report

    def _await_direct(self, state: Any, msg: BucketMsg, token: Any = None,
                      wait: Any = None) -> None:
        """After ``msg``'s header (and bytes) went out: wait until the receivers have
        them, or, for a tensor whose bytes outlive its item, only until at most
        ``_direct_window`` are unread (the receivers read the next while this thread asks
        for another). ``wait(token)`` waits for one tensor (default: every receiver's
        ack of ``msg.index``)."""
        if wait is None:
            token = msg.index
            wait = lambda index: self._await_acks(state, final=False, index=index)  # noqa: E731
        pending = state.direct_pending
        if self._direct_window > 1 and msg.entries[0].name in state.lasting:
            pending.append((token, wait))
            state.direct_unwaited += 1
            while len(pending) > self._direct_window:
                self._drain_direct(state, 1)
            return
        self._drain_direct(state)
        wait(token)

    @staticmethod
    def _drain_direct(state: Any, count: Optional[int] = None) -> None:
        """Wait for the oldest ``count`` (default: all) direct tensors not waited for yet."""
        pending = state.direct_pending
        for _ in range(len(pending) if count is None else count):
            token, wait = pending.popleft()
            wait(token)

    def _direct_on(self) -> bool:
        """Hook: may any tensor go direct now (the backend's own conditions)."""
        return False

    def _direct_deliver(self, state: Any, msg: BucketMsg, tensor: torch.Tensor) -> None:
        """Hook: send header ``msg`` and ``tensor``'s bytes, then :meth:`_await_direct`
        (the tensor may change once that returns)."""
        raise NotImplementedError

    def _tx_direct_ok(self, state: Any, name: str, tensor: torch.Tensor,
                      dtype: torch.dtype) -> bool:
        if not self._direct_on() or not plain_cpu(tensor):
            return False
        big = tensor.numel() * tensor.element_size() >= self._direct_min
        if self._direct_window > 1:
            # a tensor that may go direct, or any while one is in flight (it must not
            # rewrite those bytes): nothing to track for small ones before that
            tracker = self._lasting_tracker()
            if (big or tracker.watching) and tracker.lasting(name, tensor, version=state.version):
                state.lasting.add(name)
        return big and tensor.dtype == dtype

    def _tx_direct(self, state: Any, name: str, tensor: torch.Tensor,
                   dtype: torch.dtype) -> None:
        msg = direct_header(self, state, name, tensor, dtype)
        self._direct_deliver(state, msg, tensor)
        state.tensors += 1
        state.nbytes += msg.nbytes


class Worker:
    """One thread running blocking calls in order (a minimal executor that can be ended
    and joined, so an engine's teardown leaves no thread behind)."""

    def __init__(self, name: str) -> None:
        self._q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Any, *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # the awaiting coroutine raises it
                fut.set_exception(exc)

    def close(self, timeout: float) -> None:
        self._q.put(None)
        self._thread.join(timeout)


def wait_stream(stream: Any, timeout: float, *, peer: str, phase: str,
                version: Any) -> None:
    """Until the work queued so far on CUDA ``stream`` is done, bounded by ``timeout``
    (an event polled, not ``synchronize``, which cannot time out)."""
    event = torch.cuda.Event()
    event.record(stream)
    deadline = time.monotonic() + timeout
    delay = 20e-6
    try:
        while not event.query():
            if time.monotonic() > deadline:
                raise SyncTimeout(f"the copies queued on {peer} did not finish in "
                                  f"{timeout:.0f}s", peer=peer, phase=phase, version=version)
            time.sleep(delay)
            delay = min(2 * delay, 200e-6)
    except RuntimeError as exc:
        if isinstance(exc, WeightSyncError):
            raise
        raise PeerFailed(f"CUDA error while waiting for {peer}: {exc}", peer=peer,
                         phase=phase, version=version) from None


class BucketedEngine(CheckpointEngine, abc.ABC):
    """Send/receive logic over slot buffers; subclasses provide the data path."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._seq = 0
        self._rank = -1
        self._world = 0              # trainer ranks (streams)
        self._num_receivers = 0
        self._tx_plan: list[Bucket] = []
        self._rx_plans: dict[int, list[Bucket]] = {}
        self._ownership: Optional[Ownership] = None
        self._slot_bucket: dict[int, int] = {}   # slot -> bucket index last published there
        self._acks: set[tuple[int, int, int]] = set()   # (seq, bucket index or -1, rank)
        # the stream the caller's thread packs buckets on (CUDA; set by each send_weights):
        # the waits in this engine's own thread order on it, not on that thread's stream
        self._tx_copy_stream: Any = None
        self._tx_replay: Optional[Replay] = None   # self._tx_plan, ready to replay

    # -- data path supplied by subclasses ---------------------------------------------
    @abc.abstractmethod
    def _tx_buffer(self, slot: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def _tx_publish(self, slot: int, msg: BucketMsg) -> None: ...

    @abc.abstractmethod
    def _tx_wait_free(self, slot: int, state: _SendState) -> None: ...

    @abc.abstractmethod
    def _tx_control(self) -> Any: ...        # Inbox of this stream's sender

    @abc.abstractmethod
    def _rx_control(self, stream: int) -> Any: ...   # Inbox of this receiver for a stream

    @abc.abstractmethod
    def _rx_fetch(self, stream: int, msg: BucketMsg) -> torch.Tensor: ...

    @abc.abstractmethod
    def _rx_release(self, stream: int, msg: BucketMsg) -> None: ...

    # -- optional hooks ---------------------------------------------------------------------
    def _tx_direct_ok(self, state: _SendState, name: str, tensor: torch.Tensor,
                      dtype: torch.dtype) -> bool:
        """Hook, for every tensor to send: True if it goes to receivers without a bucket
        (see :class:`DirectTensors`)."""
        return False

    def _tx_direct(self, state: _SendState, name: str, tensor: torch.Tensor,
                   dtype: torch.dtype) -> None:
        """Hook: deliver one tensor outside the buckets; return once receivers have it."""
        raise NotImplementedError

    def _check_usable(self, version: Any) -> None:
        """Hook: raise (a ``WeightSyncError``) at the start of a sync that cannot work on
        this engine as it is (e.g. a group aborted by a failed sync: re-initialize)."""

    def _receiver_boxes(self) -> list[str]:
        return [f"r{r}" for r in range(self._num_receivers)]

    def reset_plan(self) -> None:
        self._tx_plan = []
        self._tx_replay = None
        self._rx_plans = {}
        self.__dict__.pop("_rx_staging", None)
        self.__dict__.pop("_rx_progs", None)
        if self._ownership is not None:
            self._ownership.reset()

    # -- sender ---------------------------------------------------------------------------
    async def _blocking(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` (a wait on peers) off the caller's loop, in this engine's own thread:
        a send runs one such call at a time, so one thread is its size; none is taken from
        the loop's default executor, which the caller (and its receivers) may need."""
        worker = self.__dict__.get("_tx_worker")
        if worker is None:
            worker = self.__dict__["_tx_worker"] = Worker(f"weightsync-tx{self._rank}")
        return await asyncio.wrap_future(worker.submit(fn, *args))

    def _stop_threads(self) -> None:
        """Teardown: end this engine's own thread (a call still waiting ends first); drop
        the receiver's kept staging buffers and copy programs."""
        self.__dict__.pop("_rx_staging", None)
        self.__dict__.pop("_rx_progs", None)
        worker = self.__dict__.pop("_tx_worker", None)
        if worker is not None:
            worker.close(self.config.timeout + 5)

    async def send_weights(self, named_tensors: Any, version: Any = None) -> dict[str, Any]:
        if self.config.role != "trainer" or self._rank < 0:
            raise RuntimeError(f"{self.backend_name}: send_weights needs a trainer engine "
                               "after init_process_group")
        version = normalize_version(version)
        dev = torch.device(self.config.device)
        self._tx_copy_stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
        self._seq += 1
        state = _SendState(self._seq, version, self._builder())
        start = time.perf_counter()
        try:
            self._check_usable(version)
            self._raise_held(state.seq)
            await self._tx_begin(state)
            async for name, tensor in aiter_items(named_tensors):
                if self._world > 1:
                    state.yielded.append(name)
                    if not self._ownership.should_send(name):
                        continue
                await self._pack(state, name, tensor)
            state.builder.finish()
            await self._flush(state)
            if self._world > 1:
                await self._blocking(self._ownership.agree, state.seq, state.yielded,
                                        state.version)
            await self._blocking(self._finish_stream, state)
        except BaseException as exc:
            self._abort_send(state, exc)
            raise
        return self._report(state, time.perf_counter() - start)

    def _builder(self) -> Any:
        """The plan builder of one sync: a replay of the last sync's layout when there is
        one (nothing laid out or hashed again while the weight set is the same)."""
        if not self._tx_plan:
            return PlanBuilder(self.config.bucket_size, self.config.alignment)
        if self._tx_replay is None:      # made again only when the layout changed
            self._tx_replay = Replay(self._tx_plan)
        return ReplayBuilder(self.config.bucket_size, self.config.alignment, self._tx_replay)

    async def _tx_begin(self, state: _SendState) -> None:
        """Hook, once per sync before the first tensor (may wait for receivers, off the
        caller's loop through :meth:`_blocking`)."""

    def _tx_push(self, state: _SendState, name: str, tensor: torch.Tensor,
                 dtype: torch.dtype) -> bool:
        """Hook, for every tensor to send: write it straight into every receiver's own
        memory and return True (it then takes no bucket); the backend tells receivers
        before its Done. False: the tensor goes the usual way."""
        return False

    async def _pack(self, state: _SendState, name: str, tensor: torch.Tensor) -> None:
        dtype = wire_dtype(tensor, self.config.dtype)
        if self._tx_push(state, name, tensor, dtype):
            return
        if self._tx_direct_ok(state, name, tensor, dtype):
            # it waits for the receivers: never on the caller's loop
            await self._blocking(self._tx_direct, state, name, tensor, dtype)
            return
        pieces = state.builder.add(name, tensor.shape, dtype_name(dtype))
        state.tensors += 1
        if pieces and pieces[0][1].is_chunk and (tensor.device.type != "cpu"
                                                 or self._tx_buffer_on_cpu()):
            # a tensor in chunks is cast and made contiguous once, not once per chunk (a
            # CPU tensor bound for device buckets is left to the backend, which moves it
            # to the device first and casts it there)
            tensor = chunk_source(tensor, dtype)
        for index, meta in pieces:
            if state.published < len(state.builder.closed):
                await self._flush(state, upto=index)
            if state.open_slot is None:
                state.open_slot = index % self.config.num_slots
                await self._blocking(self._tx_wait_free, state.open_slot, state)
            self._copy_piece(self._tx_buffer(state.open_slot), meta, tensor, dtype)
            state.nbytes += meta.nbytes

    def _tx_buffer_on_cpu(self) -> bool:
        return torch.device(self.config.device).type == "cpu"

    @staticmethod
    def _copy_piece(buf: torch.Tensor, meta: TensorMeta, tensor: torch.Tensor,
                    dtype: torch.dtype) -> None:
        if meta.nbytes == 0:
            return
        if not meta.is_chunk and tensor.dtype == dtype and buf.is_cpu \
                and plain_cpu(tensor):
            # the hot path of small tensors: bytes to bytes, no views made, no torch thread
            # pool (see fastcopy); the plan put exactly this many bytes at this offset
            memmove_at(buf, meta.offset, tensor, meta.nbytes)
            return
        dst = buf[meta.offset: meta.offset + meta.nbytes]
        if not meta.is_chunk:
            dst.view(dtype).view(tensor.shape).copy_(tensor, non_blocking=True)
            return
        src = as_bytes(chunk_source(tensor, dtype))   # _pack already made it so: no copy
        piece = src[meta.chunk_offset: meta.chunk_offset + meta.nbytes]
        if plain_cpu(tensor) and can_memmove(dst, piece):
            copy_into(dst, piece)
            return
        dst.copy_(piece, non_blocking=True)

    async def _flush(self, state: _SendState, upto: Optional[int] = None) -> None:
        """Publish every closed bucket with an index below ``upto`` (all if None)."""
        closed = state.builder.closed
        while state.published < len(closed) and (upto is None or state.published < upto):
            bucket = closed[state.published]
            slot = state.open_slot
            if slot is None:  # a bucket of only empty tensors
                slot = bucket.index % self.config.num_slots
                await self._blocking(self._tx_wait_free, slot, state)
            await self._blocking(self._publish, state, bucket, slot)
            state.published += 1
            state.open_slot = None

    def _publish(self, state: _SendState, bucket: Bucket, slot: int) -> None:
        cached = self._tx_plan[bucket.index] if bucket.index < len(self._tx_plan) else None
        entries = None if cached is bucket or cached == bucket else bucket.entries
        if entries is not None:
            state.changed += 1
        buf = self._tx_buffer(slot)
        self._tx_ready(slot, buf, state.version)
        crc = checksum(buf[: bucket.nbytes]) if self.config.checksum else None
        msg = BucketMsg(version=wire_version(state.version), seq=state.seq, stream=self._rank,
                        index=bucket.index, slot=slot, nbytes=bucket.nbytes,
                        layout=bucket_digest(bucket), entries=entries, checksum=crc)
        self._slot_bucket[slot] = bucket.index
        self._tx_publish(slot, msg)

    def _tx_ready(self, slot: int, buf: torch.Tensor, version: Any) -> None:
        """Hook, run in this engine's thread: the bucket's bytes are complete before the
        header (and the checksum, which reads them on the host) goes out. Default: wait for
        the stream the caller packed on; ``collective`` and ``cuda_ipc`` order their
        transfers on that stream instead and wait here only for a checksum."""
        if buf.device.type == "cuda":
            wait_stream(self._tx_copy_stream or torch.cuda.current_stream(buf.device),
                        self.config.timeout, peer="trainer stream", phase="send",
                        version=version)

    def _finish_stream(self, state: _SendState) -> None:
        plan = tuple(state.builder.closed)
        self._tx_plan = list(plan)
        if not getattr(state.builder, "replayed", False):
            self._tx_replay = None       # a new layout: its replay is compiled next sync
        done = DoneMsg(version=wire_version(state.version), seq=state.seq, stream=self._rank,
                       num_buckets=len(plan), num_tensors=state.tensors, nbytes=state.nbytes,
                       signature=plan_signature(self.config.bucket_size, plan))
        inbox = self._tx_control()
        inbox.push_many(self._receiver_boxes(), done)
        self._await_acks(state, final=True)
        self._slot_bucket.clear()

    def _await_acks(self, state: _SendState, *, final: bool, index: int = -1) -> None:
        """Pop the sender inbox until every receiver acked bucket ``index`` (or the end).
        A failure of the final wait says which receivers confirmed the whole version
        (``confirmed`` of the error: they hold it; the others may still complete it)."""
        if not final:
            return self._pop_acks(state, final=False, index=index)
        try:
            return self._pop_acks(state, final=True, index=index)
        except WeightSyncError as exc:
            if exc.confirmed is None:
                exc.confirmed = tuple(r for r in range(self._num_receivers)
                                      if (state.seq, -1, r) in self._acks)
            raise

    def _pop_acks(self, state: _SendState, *, final: bool, index: int = -1) -> None:
        inbox = self._tx_control()
        pending = set(range(self._num_receivers))
        acks = self._acks
        deadline = time.monotonic() + self.config.timeout
        while True:
            pending = {r for r in pending if (state.seq, -1 if final else index, r) not in acks}
            if not pending:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncTimeout(f"rollout ranks {sorted(pending)} did not acknowledge "
                                  f"{'the sync' if final else f'bucket {index}'} in time",
                                  peer=f"rollout rank {min(pending)}", phase="send",
                                  version=state.version)
            if hasattr(inbox, "expect"):  # a link of a finished receiver may close
                inbox.expect(pending)
            msg = inbox.pop(timeout=left, peer=f"rollout rank {min(pending)}", phase="send",
                            version=state.version)
            if isinstance(msg, ErrorMsg):
                if msg.seq == state.seq or msg.seq == 0:
                    raise_remote(msg, phase="send")
                self._hold_error(msg, state.seq)
            elif isinstance(msg, AckMsg) and msg.seq == state.seq:
                acks.add((msg.seq, -1 if msg.final else msg.index, msg.rank))
            else:
                self._tx_stash(msg)

    def _collect_offers(self, state: _SendState) -> tuple:
        """Every receiver's offer (``LandMsg``) for this sync, sent when its receive began
        (those that came early are in ``self._land_early``); records each receiver's
        landings in ``self._landings`` / ``self._land_digest`` and returns the digests in
        receiver order (bounded by the timeout)."""
        got: dict[int, Any] = {}
        for key in [k for k in self._land_early if k[0] <= state.seq]:
            msg = self._land_early.pop(key)
            if msg.seq == state.seq:
                got[msg.rank] = msg
        inbox = self._tx_control()
        deadline = time.monotonic() + self.config.timeout
        while len(got) < self._num_receivers:
            missing = min(set(range(self._num_receivers)) - set(got))
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncTimeout(f"rollout rank {missing} did not start receiving",
                                  peer=f"rollout rank {missing}", phase="send",
                                  version=state.version)
            try:
                msg = inbox.pop(timeout=left, peer=f"rollout rank {missing}", phase="send",
                                version=state.version)
            except SyncTimeout:
                raise SyncTimeout(f"rollout rank {missing} did not start receiving within "
                                  f"{self.config.timeout:.0f}s", peer=f"rollout rank {missing}",
                                  phase="send", version=state.version) from None
            if isinstance(msg, ErrorMsg) and msg.seq in (state.seq, 0):
                raise_remote(msg, phase="send")
            elif isinstance(msg, ErrorMsg):
                self._hold_error(msg, state.seq)
            elif isinstance(msg, LandMsg):
                if msg.seq == state.seq:
                    got[msg.rank] = msg
                elif msg.seq > state.seq:
                    self._land_early[(msg.seq, msg.rank)] = msg
        for rank, msg in got.items():
            if msg.landings is not None:
                self._landings[rank] = {e[0]: e for e in msg.landings}
                self._land_digest[rank] = msg.digest
            elif self._land_digest.get(rank) != msg.digest:
                raise PlanMismatch("a receiver's offer refers to one this trainer never got",
                                   peer=f"rollout rank {rank}", phase="send",
                                   version=state.version)
        return tuple(self._land_digest.get(r) for r in range(self._num_receivers))

    def _hold_error(self, msg: ErrorMsg, seq: int) -> None:
        """A receiver's report of a later sync than ``seq``, read while this rank still
        waits on ``seq`` (it skipped the next one, ``abort_receive``, right after it
        confirmed this one): kept, and raised when that sync starts (:meth:`_raise_held`)."""
        if msg.seq > seq:
            self.__dict__.setdefault("_errors_ahead", {})[msg.seq] = msg

    def _raise_held(self, seq: int) -> None:
        """At the start of sync ``seq``: raise a receiver's report of it read earlier."""
        held = self.__dict__.get("_errors_ahead")
        if held:
            for old in [k for k in held if k < seq]:
                del held[old]
            msg = held.pop(seq, None)
            if msg is not None:
                raise_remote(msg, phase="send")

    def _tx_stash(self, msg: Any) -> None:
        """Hook: a message from a receiver that is not for the wait at hand (a backend
        keeps what it needs later, e.g. a receiver's next sync's ``LandMsg``)."""

    def _abort_send(self, state: _SendState, exc: BaseException) -> None:
        """Tell every receiver that this sync is over (also relays a receiver's failure),
        and the other trainer ranks, which may be waiting for this rank's names."""
        self._acks.clear()
        self._slot_bucket.clear()
        msg = error_msg(exc, seq=state.seq, version=state.version,
                        peer=f"trainer rank {self._rank}", phase="send")
        _best_effort(lambda: self._tx_control().push_many(self._receiver_boxes(), msg))
        if self._ownership is not None:
            _best_effort(lambda: self._ownership.fail(state.seq, msg))

    def _report(self, state: _SendState, seconds: float) -> dict[str, Any]:
        self._acks.clear()
        gbps = state.nbytes / seconds / 1e9 if seconds > 0 else 0.0
        logger.info("weightsync %s: sent version %s: %d tensors, %d bytes in %.4f s "
                    "(%.2f GB/s) to %d receivers, %d/%d buckets with new layout",
                    self.backend_name, state.version, state.tensors, state.nbytes, seconds,
                    gbps, self._num_receivers, state.changed, state.published)
        return {"version": state.version, "bytes": state.nbytes, "seconds": seconds,
                "gbps": gbps, "tensors": state.tensors, "buckets": state.published,
                "buckets_with_layout": state.changed, "backend": self.backend_name,
                "direct_unwaited": state.direct_unwaited}
