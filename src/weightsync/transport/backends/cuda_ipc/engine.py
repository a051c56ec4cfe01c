"""``cuda_ipc``: trainer and rollout processes that share a GPU (colocated RL).

Each trainer rank allocates a ring of ``num_slots`` device buckets once, in
``init_process_group``, and hands every rollout rank CUDA IPC descriptors for them (one
reference each: PyTorch's cross-process reference counting keeps the memory alive until
every importer let go). Every later sync reuses the same mappings. The trainer copies
tensors into a free slot on its current CUDA stream and publishes the bucket header; a
rollout rank hands out views straight into the shared bucket (the consumer's copy into
its model is the only copy on its side). The trainer fills bucket k+1 while rollout ranks
drain bucket k; an acknowledgement is only awaited when a slot comes round again.

Ordering: the trainer records an interprocess CUDA event behind a bucket's copies and
publishes at once; the receiver's pump thread polls that event before the consumer sees
the bucket; the consumer's release records the receiver's own event on its stream. Before
the trainer refills a slot it has the receivers' acknowledgements of the slot's last
bucket and has polled their events on the host (bounded), so its caller's stream never
waits on another process's event: a dead receiver cannot stall the trainer's own work.

Tensors whose bytes outlive their item
(:class:`~weightsync.transport.tensors.ReplayedLasting`: parameters from the second sync
on, or tensors the export marked) are copied into a slot in batches (an eighth of a
bucket, and the rest at the bucket's publish), each batch by one program per slot, bucket
and batch on the caller's stream, replayed as a CUDA graph once it has covered the same
memory twice; the bucket's "filled" event is recorded behind its last batch. Batches let
the GPU start on a bucket while the trainer still packs it. Any other tensor (a
temporary, a buffer the export refills) is copied at once, so the export's later writes
stay ordered after the copy. Without checksums only: a checksum reads the bucket on the
host, so the trainer then synchronizes its stream before publishing.

At the end of a sync a receiver records a "done" event behind all its reads and
acknowledges at once, then waits for that event before its receive returns; the trainer,
once every receiver acknowledged, waits for their "done" events before ``send_weights``
returns (so the message's trip overlaps the last copies). Bucket headers and
acknowledgements travel on one Unix socket per receiver, not through the control store.
Every wait on a peer is bounded on the host (``SyncTimeout``).

Zero-copy (``zero_copy``, the default; :mod:`.refs`): tensors whose storage outlives their
item (parameters from the second sync on, tensors the export marked with ``mark_stable``)
are read by receivers straight from the trainer's memory, one copy per sync instead of
two; the ring carries the rest (temporaries, buffers the export refills), and the whole
first sync.

GPU memory a sync adds: the ring, ``num_slots x bucket_size`` on each trainer rank (2 x 256
MiB by default), allocated once by ``init_process_group`` and mapped, not copied, by the
receivers. Zero-copy adds none; a storage the trainer frees while receivers still map it
stays allocated until the end of the next sync that does not send it. A receiver adds
``receive_into``'s copy programs (CUDA graphs, a few KiB) and nothing else.

Streams: the trainer's tensors must be ready on the stream that is current when
``send_weights`` is called; a consumer must read yielded views on the stream that is
current while it iterates ``receive_weights`` (the default stream, normally).
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import torch

from weightsync.core.config import option, parse_bool
from weightsync.core.errors import PeerFailed, SyncTimeout, TopologyError, WeightSyncError
from weightsync.core.plan import TensorMeta
from weightsync.core.remote import normalize_version
from weightsync.core.wire import AckMsg, BucketMsg, HelloMsg
from weightsync.transport.protocol.sender import BucketedEngine, chunk_source
from weightsync.transport.tensors import ReplayedLasting, as_bytes
from weightsync.transport.backends.cuda_ipc.ops import CudaIpcOps, IpcOps
from weightsync.transport.backends.cuda_ipc.refs import REF_INDEX_BASE, ZeroCopyMixin
from weightsync.transport.control.group import StoreGroupMixin
from weightsync.transport.control.links import Link, LinkHub, unix_address
from weightsync.transport.protocol.receiver import Abandoned, ReceiverMixin
from weightsync.transport.registry import CheckpointEngineRegistry

__all__ = ["CudaIpcEngine", "CudaIpcOptions", "GRAPH_BRANCHES"]

#: Independent chains a captured copy program (a CUDA graph) runs its copies in (see
#: :class:`~weightsync.transport.backends.cuda_ipc.ops.GraphedCopies`).
GRAPH_BRANCHES = 4


@dataclass(kw_only=True)
class CudaIpcOptions:
    """Options of ``cuda_ipc`` beyond :class:`~weightsync.core.config.EngineConfig`.

    Keyword arguments of the engine (``connect("cuda_ipc", ..., zero_copy=True)``) or one
    object (``options=CudaIpcOptions(...)``); the trainer's setting wins.
    """

    zero_copy: bool = option(
        "CUDA_IPC_ZERO_COPY", parse_bool, True,
        "Receivers read tensors whose storage outlives the sync (parameters) straight from "
        "the trainer's memory; False: every tensor goes through the ring.")

    def __post_init__(self) -> None:
        if not isinstance(self.zero_copy, bool):
            raise ValueError(f"zero_copy must be a bool, got {self.zero_copy!r}")


class _AckPusher:
    """A receiver's messages to one trainer, sent in order by a background thread.

    The consumer only queues per-bucket acknowledgements, so it never waits for the control
    server between buckets; acknowledgements of zero-copy batches are dropped (nothing
    waits for them). Final acknowledgements and errors drain the queue first, then go out
    from the caller's thread.
    """

    def __init__(self, inbox: Any, name: str, timeout: float) -> None:
        self._inbox, self._timeout = inbox, timeout
        self._q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._pending = 0
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def push(self, box: str, msg: Any) -> None:
        if isinstance(msg, AckMsg) and not msg.final:
            if msg.index >= REF_INDEX_BASE:
                return
            self._raise()
            with self._cv:
                self._pending += 1
            self._q.put((box, msg))
            return
        self.flush(self._timeout if isinstance(msg, AckMsg) else min(1.0, self._timeout))
        self._inbox.push(box, msg)

    def flush(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._pending and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cv.wait(left):
                    # the store lives in the trainer's process: its fault, not this replica's
                    raise SyncTimeout("acknowledgements could not be sent in time",
                                      peer=getattr(self._inbox, "host", "trainer rank 0"),
                                      phase="receive")
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            try:
                self._inbox.push(*item)
            except BaseException as exc:  # raised to the consumer at its next push
                self._error = exc
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)


@CheckpointEngineRegistry.register("cuda_ipc")
class CudaIpcEngine(ZeroCopyMixin, StoreGroupMixin, ReceiverMixin, BucketedEngine):
    """Same-GPU (or same-host) multi-process transport over CUDA IPC."""

    capabilities = frozenset({"cuda", "same_host"})
    options_cls = CudaIpcOptions
    options: CudaIpcOptions
    _rx_programs = True   # receive_into replays each bucket's copies (a CUDA graph on a GPU)
    #: Builds the device operations for a device string (tests swap in a CPU stand-in).
    ops_factory: ClassVar[Callable[[str], IpcOps]] = CudaIpcOps

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("device") is None and not os.environ.get("WEIGHTSYNC_DEVICE"):
            kwargs["device"] = "cuda"          # else EngineConfig reads WEIGHTSYNC_DEVICE
        super().__init__(**kwargs)
        self._ops = type(self).ops_factory(self.config.device)
        self.config.device = str(self._ops.device)
        self._bufs: list[torch.Tensor] = []
        self._tx_stream: Any = None
        self._tx_version: Any = None
        self._filled: list[Any] = []               # sender: per slot (+1 for zero-copy)
        self._drained: list[list[Any]] = []        # sender: per receiver, per slot (opened)
        self._rx_filled: dict[int, list[Any]] = {}     # receiver: per stream (opened)
        self._rx_drained: dict[int, list[Any]] = {}    # receiver: per stream, per slot
        self._rx_bufs: dict[int, list[torch.Tensor]] = {}
        self._ackers: dict[int, _AckPusher] = {}
        self._dst_views: dict[tuple, torch.Tensor] = {}   # sender: views into slots
        self._filling = 0                   # the slot being filled
        self._lasting = ReplayedLasting()
        self._chunk_src: tuple = ()         # (tensor, dtype, its wire bytes) being chunked
        self._batch_bytes = max(self.config.bucket_size // 8, 1)
        # fill programs: the open batch's held copies, and per (slot, bucket of the sync,
        # batch) the program that issues them (its pairs' memory, its runner)
        self._on_graph = False
        self._tracking = False              # this sync asks the lasting tracker
        self._graph_pairs: list[tuple] = []
        self._graph_bytes = 0               # bytes of the held batch
        self._fill_at = (0, 0)              # (bucket of this sync, batch of it) held now
        self._fill_progs: dict[tuple, tuple] = {}
        self._graph_count = 0
        self._init_refs()

    # -- set-up ---------------------------------------------------------------------------
    def _init_sender(self) -> None:
        size, n = self.config.bucket_size, self.config.num_slots
        self._bufs = [self._ops.alloc(size) for _ in range(n)]
        self._region_store = self._server.clone()
        self._clients.append(self._region_store)  # closed by _leave
        per_slot = [self._ops.export(buf, self._num_receivers) for buf in self._bufs]
        self._filled = [self._ops.new_event() for _ in range(n + 1)]
        events = tuple(self._ops.event_handle(e) for e in self._filled)
        # headers and acks on a socket per receiver
        self._hub = LinkHub(socket.AF_UNIX, unix_address(self._token, self._rank),
                            self._token, self.config.timeout)
        for r in range(self._num_receivers):
            self._tx_inbox.push(f"r{r}", HelloMsg(
                stream=self._rank, rank=r, bucket_size=size, num_slots=n,
                handles=tuple(descs[r] for descs in per_slot) + events, segments=("link",)))
        self._drained = [[] for _ in range(self._num_receivers)]
        attached: set[int] = set()
        deadline = time.monotonic() + self.config.timeout
        while len(attached) < self._num_receivers:
            left = deadline - time.monotonic()
            missing = sorted(set(range(self._num_receivers)) - attached)
            if left <= 0:
                raise SyncTimeout(f"rollout ranks {missing} did not map the buffers",
                                  peer=f"rollout rank {missing[0]}", phase="init")
            msg = self._tx_inbox.pop(timeout=left, peer=f"rollout rank {missing[0]}",
                                     phase="init")
            if isinstance(msg, HelloMsg) and 0 <= msg.rank < self._num_receivers:
                self._drained[msg.rank] = [self._open_event(h, f"rollout rank {msg.rank}")
                                           for h in msg.handles]
                if len(self._drained[msg.rank]) != n + 1:   # per slot, and "done"
                    raise TopologyError("a receiver sent the wrong number of events",
                                        peer=f"rollout rank {msg.rank}", phase="init")
                attached.add(msg.rank)
        self._hub.accept(self._num_receivers, deadline)

    def _open_event(self, handle: str, peer: str) -> Any:
        try:
            return self._ops.open_event(handle)
        except (ValueError, RuntimeError) as exc:
            raise TopologyError(f"cannot open an event of {peer}: {exc}", peer=peer,
                                phase="init") from None

    def _init_receiver(self) -> None:
        replies: dict[int, HelloMsg] = {}
        self._links = {}            # this engine's own (the mixin's default is shared)
        for s in range(self._world):
            peer = f"trainer rank {s}"
            msg = self._rx_pop[s].pop(peer=peer, phase="init")
            if not isinstance(msg, HelloMsg) or msg.stream != s or msg.rank != self._rank:
                raise TopologyError(f"expected the buffer descriptors, got {msg.kind!r}",
                                    peer=peer, phase="init")
            n = msg.num_slots
            if msg.bucket_size != self.config.bucket_size or n < 1 \
                    or len(msg.handles) != 2 * n + 1 or "link" not in msg.segments:
                raise TopologyError(
                    f"trainer uses bucket_size={msg.bucket_size} with {msg.num_slots} slots, "
                    f"this rollout engine bucket_size={self.config.bucket_size}; configure "
                    "both sides alike", peer=peer, phase="init")
            self._rx_bufs[s] = [self._open(d, msg.bucket_size, peer) for d in msg.handles[:n]]
            self._rx_region_store[s] = self._rx_pop[s]._store.clone()
            self._clients.append(self._rx_region_store[s])  # closed by _leave
            self._rx_filled[s] = [self._open_event(h, peer) for h in msg.handles[n:]]
            # one per slot, then "done": every read of a sync (the trainer waits for it
            # after the final acknowledgement, which goes out before it completes)
            self._rx_drained[s] = [self._ops.new_event() for _ in range(n + 1)]
            # connected before the hello: the trainer accepts
            self._links[s] = Link(socket.AF_UNIX, unix_address(self._token, s), self._token,
                                  self._rank, self.config.timeout, peer=peer)
            self._ackers[s] = _AckPusher(self._links[s], f"weightsync-ack{self._rank}-s{s}",
                                         self.config.timeout)
            mine = tuple(self._ops.event_handle(e) for e in self._rx_drained[s])
            replies[s] = HelloMsg(stream=s, rank=self._rank, bucket_size=msg.bucket_size,
                                  num_slots=n, handles=mine)
        for s, reply in replies.items():
            self._rx_push[s].push("t", reply)

    def _open(self, descriptor: str, min_size: int, peer: str) -> torch.Tensor:
        try:
            buf = self._ops.open(descriptor)
        except (ValueError, RuntimeError) as exc:
            raise TopologyError(f"cannot map a buffer of {peer}: {exc}", peer=peer,
                                phase="init") from None
        if buf.numel() < min_size:
            raise TopologyError(f"buffer of {peer} has {buf.numel()} bytes, expected "
                                f"{min_size}", peer=peer, phase="init")
        return buf

    # -- stream capture -------------------------------------------------------------------
    async def send_weights(self, named_tensors: Any, version: Any = None) -> dict[str, Any]:
        version = normalize_version(version)  # the bucketed sender keeps it as given
        self._tx_stream = self._ops.current_stream()
        self._tx_version = version
        self._graph_count = 0
        self._clear_refs()
        # the lasting tracker, for fill programs (asked once per sync; not with a
        # checksum, which reads the bucket on the host)
        track = self._tracking = not self.config.checksum
        if track:
            self._lasting.begin()
        try:
            report = await super().send_weights(named_tensors, version)
        except BaseException:
            if track:
                self._lasting.reset()   # a failed sync: trust no storage from before it
            raise
        finally:
            self._clear_refs()
            self._chunk_src = ()
            self._graph_pairs, self._graph_bytes, self._fill_at = [], 0, (0, 0)
        if track:
            self._lasting.finish()
        return report

    def _tx_direct_ok(self, state: Any, name: str, tensor: torch.Tensor,
                      dtype: torch.dtype) -> bool:
        """The protocol's per-tensor hook (for a tensor that goes into the buckets): no
        tensor skips them here; decide whether this one is held for the bucket's fill
        program (see the module doc)."""
        asked, self._asked = self._asked, None     # :meth:`_pack` asked the tracker
        self._on_graph = asked is not None and asked[0] is tensor and asked[1] \
            and dtype == tensor.dtype
        self._graph_count += self._on_graph
        return False

    def _report(self, state: Any, seconds: float) -> dict[str, Any]:
        out = super()._report(state, seconds)
        out["fill_graph_tensors"] = self._graph_count   # copied by fill programs
        return out

    def _rx_control(self, stream: int) -> Any:
        return self._ackers[stream]

    def _sync(self, stream: Any, *, peer: str, phase: str, version: Any) -> None:
        try:
            self._ops.sync(stream)
        except RuntimeError as exc:  # a CUDA error (e.g. a dead exporter's memory)
            raise PeerFailed(f"CUDA error while waiting for copies: {exc}", peer=peer,
                             phase=phase, version=version) from None

    def _wait_event(self, event: Any, *, peer: str, phase: str, version: Any) -> None:
        """Poll an event of the other process until its work is done (bounded)."""
        deadline = time.monotonic() + self.config.timeout
        delay = 10e-6
        try:
            while not self._ops.done(event):
                if phase == "receive" and self._rx_over():
                    raise Abandoned("the receive ended", phase=phase, version=version)
                if time.monotonic() > deadline:
                    raise SyncTimeout(f"copies of {peer} did not finish in "
                                      f"{self.config.timeout:.0f}s", peer=peer, phase=phase,
                                      version=version)
                time.sleep(delay)
                delay = min(2 * delay, 100e-6)
        except RuntimeError as exc:
            if isinstance(exc, WeightSyncError):
                raise
            raise PeerFailed(f"CUDA error while waiting for {peer}: {exc}", peer=peer,
                             phase=phase, version=version) from None

    # -- ring buckets -----------------------------------------------------------------------
    def _tx_buffer(self, slot: int) -> torch.Tensor:
        return self._bufs[slot]

    def _copy_piece(self, buf: torch.Tensor, meta: TensorMeta, tensor: torch.Tensor,
                    dtype: torch.dtype) -> None:
        if not meta.nbytes:
            return
        if meta.is_chunk:
            chunked = self._chunk_src
            if not chunked or chunked[0] is not tensor or chunked[1] != dtype:
                # cast / made contiguous once per tensor, not once per chunk
                src = tensor.to(buf.device) if tensor.device != buf.device else tensor
                src = as_bytes(chunk_source(src, dtype))
                chunked = self._chunk_src = (tensor, dtype, src)
            src = chunked[2]
            self._copy(buf[meta.offset: meta.offset + meta.nbytes],
                       src[meta.chunk_offset: meta.chunk_offset + meta.nbytes])
            if meta.is_last_chunk:
                self._chunk_src = ()
            return
        if tensor.device.type == "cpu" and buf.device.type != "cpu":
            tensor = tensor.to(buf.device)  # blocking: the caller may reuse its CPU tensor
        # Replayed layouts put the same tensors at the same places: keep the slot views.
        key = (id(buf), meta.offset, dtype, tensor.shape)
        dst = self._dst_views.get(key)
        if dst is None:
            if len(self._dst_views) > 16384:
                self._dst_views.clear()
            dst = buf[meta.offset: meta.offset + meta.nbytes].view(dtype).view(tensor.shape)
            self._dst_views[key] = dst
        self._copy(dst, tensor)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A kept tensor's copy is held for its batch's program (a batch of about an
        eighth of a bucket, or at the bucket's end); any other is queued now on the
        caller's stream."""
        if self._on_graph:     # its bytes outlive the item: held for its batch's program
            self._graph_pairs.append((dst, src))
            self._graph_bytes += dst.numel() * dst.element_size()
            if self._graph_bytes >= self._batch_bytes:
                self._issue_fill(self._filling)
        else:
            self._ops.copy(dst, src, None)

    def _issue_fill(self, slot: int) -> None:
        """Issue the held batch of copies into ``slot`` on the caller's stream, through the
        program of that slot, bucket and batch: the same one while they cover the same
        memory (a CUDA graph from its second use on), else a new one."""
        pairs, self._graph_pairs, self._graph_bytes = self._graph_pairs, [], 0
        if not pairs:
            return
        bucket, batch = self._fill_at
        self._fill_at = (bucket, batch + 1)
        memory = tuple((d.data_ptr(), s.data_ptr(), d.numel() * d.element_size(), d.dtype,
                        s.dtype) for d, s in pairs)
        key = (slot, bucket, batch)
        prog = self._fill_progs.get(key)
        if prog is None or prog[0] != memory:
            if len(self._fill_progs) > 4096:
                self._fill_progs.clear()
            prog = self._fill_progs[key] = (
                memory, self._ops.copy_runner(GRAPH_BRANCHES))
        self._ops.run_copies(prog[1], lambda: pairs, self._tx_stream)

    def _flush_fill(self, slot: int) -> None:
        """At a bucket's publish: issue its last held batch (before its "filled" record)."""
        self._issue_fill(slot)
        self._fill_at = (self._fill_at[0] + 1, 0)

    def _tx_ready(self, slot: int, buf: torch.Tensor, version: Any) -> None:
        if self.config.checksum:  # the checksum reads the bucket on the host right away
            self._sync(self._tx_stream, peer="trainer stream", phase="send", version=version)

    def _tx_done(self, slot: int, version: Any) -> None:
        """The bytes queued for ``slot`` (or the zero-copy tensors) are, or will be, ready."""
        self._ops.record(self._filled[slot], self._tx_stream)

    def _tx_publish(self, slot: int, msg: BucketMsg) -> None:
        self._flush_fill(slot)
        self._tx_done(slot, msg.version)
        self._tx_control().push_many(self._receiver_boxes(), msg)

    def _tx_wait_free(self, slot: int, state: Any) -> None:
        """Before ``slot`` is refilled: the receivers acknowledged its last bucket, and the
        host waits (bounded) until their reads of it are done."""
        self._filling = slot
        prev = self._slot_bucket.get(slot)
        if prev is None:
            return
        self._await_acks(state, final=False, index=prev)
        for r, events in enumerate(self._drained):
            self._wait_event(events[slot], peer=f"rollout rank {r}", phase="send",
                             version=self._tx_version)

    def _rx_fetch(self, stream: int, msg: BucketMsg) -> Any:
        bufs = self._rx_bufs[stream]
        ring = msg.slot < len(bufs) and msg.index < REF_INDEX_BASE
        if not ring and not (msg.slot == len(bufs) and msg.index >= REF_INDEX_BASE):
            raise TopologyError(f"slot {msg.slot} / bucket {msg.index} does not exist",
                                peer=f"trainer rank {stream}", phase="receive",
                                version=msg.version)
        if ring or not msg.ready:
            self._wait_event(self._rx_filled[stream][msg.slot], peer=f"trainer rank {stream}",
                             phase="receive", version=msg.version)
        return bufs[msg.slot] if ring else self._fetch_regions(stream, msg)

    def _rx_copy_runner(self) -> Any:
        return self._ops.copy_runner(GRAPH_BRANCHES)

    def _rx_release(self, stream: int, msg: BucketMsg) -> None:
        if msg.index >= REF_INDEX_BASE:
            return  # zero-copy reads finish before the final acknowledgement
        # The consumer reads on its current stream; the ack that follows frees the slot.
        self._ops.record(self._rx_drained[stream][msg.slot], self._ops.current_stream())

    def _rx_finish_stream(self, state: Any, stream: int, msg: Any) -> None:
        # Every read (zero-copy ones too) is done before this receive returns. The final
        # acknowledgement goes out first, behind the "done" event recorded after the
        # reads: the trainer waits for that event itself, so the message's trip overlaps
        # the GPU's last copies instead of following them.
        done = self._rx_drained[stream][-1]
        self._ops.record(done, self._ops.current_stream())
        super()._rx_finish_stream(state, stream, msg)
        self._wait_event(done, peer=f"rollout rank {self._rank}", phase="receive",
                         version=msg.version)

    def _finish_stream(self, state: Any) -> None:
        super()._finish_stream(state)        # every receiver acknowledged the end ...
        for r, events in enumerate(self._drained):
            # ... and its reads are done (it acknowledges before they are)
            self._wait_event(events[-1], peer=f"rollout rank {r}", phase="send",
                             version=state.version)

    # -- teardown ---------------------------------------------------------------------------
    def _release(self) -> None:
        self._stop_threads()
        for acker in self._ackers.values():
            acker.close()
        self._ackers = {}
        self._dst_views = {}
        self._fill_progs, self._graph_pairs = {}, []
        self._bufs, self._rx_bufs = [], {}
        self._filled, self._drained, self._rx_filled, self._rx_drained = [], [], {}, {}
        if self._hub is not None:
            self._hub.close()
        for link in self._links.values():
            link.close()
        self._hub, self._links = None, {}
        self._lasting.reset()
        self._rx_regions, self._rx_used, self._rx_region_store = {}, {}, {}
        self._regions = {}
        self._region_store = None
        self._clear_refs()
        self._ops.collect()
        self._leave()

    def finalize(self) -> None:
        self._release()
        self.close_server()
