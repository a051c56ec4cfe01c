"""``cuda_ipc``: trainer and rollout processes that share a GPU (colocated RL).

Each trainer rank allocates a ring of ``num_slots`` device buckets once, in
``init_process_group``, and hands every rollout rank CUDA IPC descriptors for them (one
reference each: PyTorch's cross-process reference counting keeps the memory alive until
every importer let go). Every later sync reuses the same mappings. The trainer copies
tensors into a free slot on its current CUDA stream and publishes the bucket header; a
rollout rank hands out views straight into the shared bucket (the consumer's copy into
its model is the only copy on its side). The trainer fills bucket k+1 while rollout ranks
drain bucket k; an acknowledgement is only awaited when a slot comes round again.

Ordering (``sync``): with ``"event"`` (default) the trainer records an interprocess CUDA
event behind a bucket's copies and publishes at once; the receiver's pump thread polls
that event before the consumer sees the bucket; the consumer's release records the
receiver's own event on its stream. Before the trainer refills a slot it has the
receivers' acknowledgements of the slot's last bucket, and then orders the refill after
their reads in one of two ways:

* tensors whose bytes outlive their item (:class:`~weightsync.transport.tensors.ReplayedLasting`:
  parameters from the second sync on, or tensors the export marked) are copied on a
  stream of the engine's own, the *ring stream*, which waits for the receivers' events
  on the GPU (``cudaStreamWaitEvent``): the trainer's host never waits for the GPU, so
  the next bucket's copies are queued while the receivers still read the last one
  (``stream_waits``, default off: on one H200 it measured level with the host waits,
  BENCHMARKS.md). Their bytes do not change within the sync, so their
  copies are queued in batches (an eighth of a bucket, and at the bucket's end), each
  behind one wait for the caller's stream (no per-tensor stream switch or event);
* any other tensor (a temporary, a buffer the export refills) is copied on the caller's
  stream once the trainer has polled the receivers' events on the host, so the export's
  later writes stay ordered after the copy.

With ``fill_graphs`` (and no ring stream) such lasting tensors' copies are instead held
in batches (an eighth of a bucket, and the rest at the bucket's publish), each batch copied
into the slot on the caller's stream by one program per slot, bucket and batch, replayed
as a CUDA graph once it has covered the same memory twice; the bucket's "filled" event is
recorded behind its last batch. Batches let the GPU start on a bucket while the trainer
still packs it (one program per whole bucket left the GPU idle for the pack's host time:
about 1.1 ms of a 4 GiB bucket on one H200). The slot was freed on the host before the
bucket's first copy, as for any other tensor.

On the trainer no stream of the caller ever waits on another process's event: only the
ring stream does, so a dead receiver can stall the ring, never the trainer's own work
(receivers opt into such waits with ``rx_stream_waits``, see :class:`CudaIpcOptions`). The ring's
slots are kept from the allocator while it may still use them; a sync that follows a
failed one first waits (bounded) until the ring has drained, else it asks for a new
``init_process_group``. Every wait on a peer is bounded on the host (``SyncTimeout``).
With ``"host"`` the trainer synchronizes its stream before publishing and the receiver
its consumer's stream before acknowledging. At the end of a sync a receiver (with
``"event"``) records a "done" event behind all its reads and acknowledges at once, then
waits for that event before its receive returns; the trainer, once every receiver
acknowledged, waits for their "done" events before ``send_weights`` returns (so the
message's trip overlaps the last copies). With ``"host"`` the receiver synchronizes its
consumer's stream before the final acknowledgement.

Zero-copy option (``zero_copy=True``, see :mod:`._cudaipc_refs`): eligible tensors are
read straight from the trainer's memory, one copy per sync instead of two.

Streams: the trainer's tensors must be ready on the stream that is current when
``send_weights`` is called; a consumer must read yielded views on the stream that is
current while it iterates ``receive_weights`` (the default stream, normally).
"""

from __future__ import annotations

import dataclasses
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import torch

from weightsync.core.config import env_value, parse_bool
from weightsync.core.errors import PeerFailed, SyncTimeout, TopologyError, WeightSyncError
from weightsync.core.plan import TensorMeta
from weightsync.core.remote import normalize_version
from weightsync.core.wire import AckMsg, BucketMsg, HelloMsg
from weightsync.transport.protocol.sender import BucketedEngine, chunk_source
from weightsync.transport.tensors import ReplayedLasting, as_bytes
from weightsync.transport.backends.cuda_ipc.ops import CudaIpcOps, IpcOps
from weightsync.transport.backends.cuda_ipc.push import PushMixin
from weightsync.transport.backends.cuda_ipc.refs import REF_INDEX_BASE, ZeroCopyMixin
from weightsync.transport.control.group import StoreGroupMixin
from weightsync.transport.control.links import Link, LinkHub, unix_address
from weightsync.transport.protocol.receiver import Abandoned, ReceiverMixin
from weightsync.transport.registry import CheckpointEngineRegistry

__all__ = ["CudaIpcEngine", "CudaIpcOptions"]

_RING, _FREE = 1, 2    # how a slot's refill is ordered after the receivers' reads


@dataclass(kw_only=True)
class CudaIpcOptions:
    """Options of ``cuda_ipc`` beyond :class:`~weightsync.core.config.EngineConfig`.

    ``zero_copy`` (env ``WEIGHTSYNC_CUDA_IPC_ZERO_COPY``): receivers read eligible tensors
    straight from the trainer's memory. ``min_ref_bytes`` (env
    ``WEIGHTSYNC_CUDA_IPC_MIN_REF_BYTES``): smaller tensors are packed into buckets even
    then (default 0: every eligible tensor). ``ref_batch_bytes``: bytes of zero-copy
    tensors announced per message (default: ``ref_first_bytes`` for the first message,
    doubling with each next one). ``ref_first_bytes`` (env
    ``WEIGHTSYNC_CUDA_IPC_REF_FIRST_BYTES``, default the bucket size, at most that): the
    first message goes out once that much is announced. ``links`` (env ``WEIGHTSYNC_CUDA_IPC_LINKS``, the
    trainer's setting wins): bucket headers and acknowledgements go over one Unix socket
    per receiver instead of the control store, whose server threads share the trainer's
    GIL (as ``shm`` does). ``rx_stream_waits`` (env ``WEIGHTSYNC_CUDA_IPC_RX_STREAM_WAITS``,
    receiver side, default off): the consumer's stream waits for a bucket's fill on the
    GPU instead of the receiver's host, so its reads are queued before the bytes land;
    the receive's end still waits for them on the host, bounded. The price: a trainer that
    dies with a fill queued leaves that stream waiting for good (the receive fails with
    ``SyncTimeout``; the process must be restarted to use the GPU again). ``stream_waits`` (env
    ``WEIGHTSYNC_CUDA_IPC_STREAM_WAITS``, trainer side, ``"event"`` ordering without
    checksums only): lasting tensors are copied on the ring stream, whose refills wait for
    the receivers on the GPU, not on the host (see the module doc). ``sync`` (env
    ``WEIGHTSYNC_CUDA_IPC_SYNC``,
    the trainer's setting wins): ``"event"`` orders bucket
    handoffs with interprocess CUDA events that the other side polls (no thread blocks on a
    stream per bucket); ``"host"`` synchronizes the producing / consuming stream instead.
    ``graph_branches`` (env ``WEIGHTSYNC_CUDA_IPC_GRAPH_BRANCHES``, receiver side, 1 to 16,
    default 4): a ``receive_into`` copy program, once captured as a CUDA graph, runs its
    copies in that many independent chains (see :class:`~weightsync.transport.backends.cuda_ipc.ops.GraphedCopies`;
    on one H200, 291 copies of a 16 GB model: 8.06 ms in one chain, 7.58 ms in 4, the
    flat copy's rate). ``fill_graphs`` (env ``WEIGHTSYNC_CUDA_IPC_FILL_GRAPHS``, trainer side,
    ``"event"`` ordering without checksums, default on): the copies of tensors whose
    bytes outlive their item (parameters from the second sync on, see the module doc) into
    a ring slot are held in batches of an eighth of a bucket (the last one until the
    bucket's publish), each issued as one replayed program on the caller's stream (a CUDA
    graph in ``graph_branches`` chains from its second use on), as receivers land
    ``receive_into``'s copies; any other tensor is still copied at once. On one H200
    (16 GB bf16, 4 GiB buckets) the ring took 17.9 ms from the fourth sync on with them,
    18.8 ms without; the third sync, where the programs are captured, pays about 25 ms
    once. ``push`` (env ``WEIGHTSYNC_CUDA_IPC_PUSH``, default off; on both sides, with
    ``"event"`` ordering, no checksum): a receiver's ``receive_into`` offers its tensors on
    the shared GPU and the trainer writes every tensor all receivers offered straight into
    them, one copy on its own stream, no bucket (see
    :mod:`~weightsync.transport.backends.cuda_ipc.push`).
    """

    zero_copy: bool = field(default_factory=lambda: env_value("CUDA_IPC_ZERO_COPY", parse_bool, False))
    min_ref_bytes: int = field(
        default_factory=lambda: env_value("CUDA_IPC_MIN_REF_BYTES", int, 0))
    ref_batch_bytes: Optional[int] = None
    ref_first_bytes: Optional[int] = field(
        default_factory=lambda: env_value("CUDA_IPC_REF_FIRST_BYTES", int, None))
    sync: str = field(default_factory=lambda: env_value("CUDA_IPC_SYNC", str, "event"))
    stream_waits: bool = field(
        default_factory=lambda: env_value("CUDA_IPC_STREAM_WAITS", parse_bool, False))
    graph_branches: int = field(
        default_factory=lambda: env_value("CUDA_IPC_GRAPH_BRANCHES", int, 4))
    links: bool = field(default_factory=lambda: env_value("CUDA_IPC_LINKS", parse_bool, True))
    rx_stream_waits: bool = field(
        default_factory=lambda: env_value("CUDA_IPC_RX_STREAM_WAITS", parse_bool, False))
    fill_graphs: bool = field(
        default_factory=lambda: env_value("CUDA_IPC_FILL_GRAPHS", parse_bool, True))
    push: bool = field(default_factory=lambda: env_value("CUDA_IPC_PUSH", parse_bool, False))

    def __post_init__(self) -> None:
        if self.sync not in ("event", "host"):
            raise ValueError(f"sync must be 'event' or 'host', got {self.sync!r}")
        for name in ("zero_copy", "stream_waits", "links", "rx_stream_waits", "fill_graphs",
                     "push"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.graph_branches, bool) or not isinstance(self.graph_branches, int) \
                or not 1 <= self.graph_branches <= 16:
            raise ValueError(f"graph_branches must be an int from 1 to 16, got "
                             f"{self.graph_branches!r}")
        for name in ("min_ref_bytes", "ref_batch_bytes", "ref_first_bytes"):
            value = getattr(self, name)
            if value is None and name != "min_ref_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")


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
class CudaIpcEngine(PushMixin, ZeroCopyMixin, StoreGroupMixin, ReceiverMixin, BucketedEngine):
    """Same-GPU (or same-host) multi-process transport over CUDA IPC."""

    capabilities = frozenset({"cuda", "same_host"})
    _rx_programs = True   # receive_into replays each bucket's copies (a CUDA graph on a GPU)
    #: Builds the device operations for a device string (tests swap in a CPU stand-in).
    ops_factory: ClassVar[Callable[[str], IpcOps]] = CudaIpcOps

    def __init__(self, *, zero_copy: Optional[bool] = None, min_ref_bytes: Optional[int] = None,
                 ref_batch_bytes: Optional[int] = None, ref_first_bytes: Optional[int] = None,
                 sync: Optional[str] = None,
                 stream_waits: Optional[bool] = None, links: Optional[bool] = None,
                 rx_stream_waits: Optional[bool] = None, graph_branches: Optional[int] = None,
                 fill_graphs: Optional[bool] = None, push: Optional[bool] = None,
                 **kwargs: Any) -> None:
        if kwargs.get("device") is None:
            kwargs["device"] = "cuda"
        super().__init__(**kwargs)
        given = {"zero_copy": zero_copy, "min_ref_bytes": min_ref_bytes,
                 "ref_batch_bytes": ref_batch_bytes, "ref_first_bytes": ref_first_bytes,
                 "sync": sync,
                 "stream_waits": stream_waits, "links": links,
                 "rx_stream_waits": rx_stream_waits, "graph_branches": graph_branches,
                 "fill_graphs": fill_graphs, "push": push}
        self.options = CudaIpcOptions(**{k: v for k, v in given.items() if v is not None})
        self._ops = type(self).ops_factory(self.config.device)
        self.config.device = str(self._ops.device)
        self._bufs: list[torch.Tensor] = []
        self._tx_stream: Any = None
        self._tx_version: Any = None
        self._events = False                       # ordering by events (the trainer decides)
        self._filled: list[Any] = []               # sender: per slot (+1 for zero-copy)
        self._drained: list[list[Any]] = []        # sender: per receiver, per slot (opened)
        self._rx_filled: dict[int, list[Any]] = {}     # receiver: per stream (opened)
        self._rx_drained: dict[int, list[Any]] = {}    # receiver: per stream, per slot
        self._rx_bufs: dict[int, list[torch.Tensor]] = {}
        self._ackers: dict[int, _AckPusher] = {}
        self._dst_views: dict[tuple, torch.Tensor] = {}   # sender: views into slots
        # sender, with stream_waits: the ring stream, an event marking the caller's stream,
        # the mark of a failed sync's ring work, per slot how its current refill is
        # ordered (_RING: the ring waits for the receivers; _FREE: the host saw them done)
        self._ring: Any = None
        self._mark: Any = None
        self._fence: Any = None
        self._gate: list[int] = []
        self._filling = 0                   # the slot being filled
        self._on_ring = False               # the tensor being packed is copied on the ring
        self._ring_count = 0
        self._lasting = ReplayedLasting()
        self._chunk_src: tuple = ()         # (tensor, dtype, its wire bytes) being chunked
        self._deferred: list[tuple] = []    # the open bucket's copies of kept tensors
        self._deferred_bytes = 0
        self._batch_bytes = max(self.config.bucket_size // 8, 1)
        # fill_graphs: the open batch's held copies, and per (slot, bucket of the sync,
        # batch) the program that issues them (its pairs' memory, its runner)
        self._on_graph = False
        self._tracking = False              # this sync asks the lasting tracker
        self._graph_pairs: list[tuple] = []
        self._graph_bytes = 0               # bytes of the held batch
        self._fill_at = (0, 0)              # (bucket of this sync, batch of it) held now
        self._fill_progs: dict[tuple, tuple] = {}
        self._graph_count = 0
        self._init_refs()
        self._init_push()

    # -- set-up ---------------------------------------------------------------------------
    def _init_sender(self) -> None:
        size, n = self.config.bucket_size, self.config.num_slots
        self._bufs = [self._ops.alloc(size) for _ in range(n)]
        self._region_store = self._server.clone()
        self._clients.append(self._region_store)  # closed by _leave
        per_slot = [self._ops.export(buf, self._num_receivers) for buf in self._bufs]
        self._events = self.options.sync == "event"
        self._filled = [self._ops.new_event() for _ in range(n + 1)] if self._events else []
        self._gate = [_FREE] * n
        if self._events and self.options.stream_waits and not self.config.checksum:
            self._ring = self._ops.new_stream()
            self._mark = self._ops.new_event()
            for buf in self._bufs:  # freed memory stays out of reach until the ring is done
                self._ops.keep_for(buf, self._ring)
        events = tuple(self._ops.event_handle(e) for e in self._filled)
        if self.options.links:   # headers and acks on a socket per receiver (below)
            self._hub = LinkHub(socket.AF_UNIX, unix_address(self._token, self._rank),
                                self._token, self.config.timeout)
        for r in range(self._num_receivers):
            self._tx_inbox.push(f"r{r}", HelloMsg(
                stream=self._rank, rank=r, bucket_size=size, num_slots=n,
                handles=tuple(descs[r] for descs in per_slot) + events,
                segments=(("link",) if self._hub is not None else ())
                + (("push",) if self._pushes_ok() else ())))
        self._drained = [[] for _ in range(self._num_receivers)]
        attached: set[int] = set()
        pushing: set[int] = set()
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
                if self._events:
                    self._drained[msg.rank] = [self._open_event(h, f"rollout rank {msg.rank}")
                                               for h in msg.handles]
                    if len(self._drained[msg.rank]) != n + 1:   # per slot, and "done"
                        raise TopologyError("a receiver sent the wrong number of events",
                                            peer=f"rollout rank {msg.rank}", phase="init")
                attached.add(msg.rank)
                if "push" in msg.segments:
                    pushing.add(msg.rank)
        # pushes: every receiver offers its tensors at every receive (and it asked for them)
        self._push = self._pushes_ok() and len(pushing) == self._num_receivers
        if self._hub is not None:
            self._hub.accept(self._num_receivers, deadline)

    def _open_event(self, handle: str, peer: str) -> Any:
        try:
            return self._ops.open_event(handle)
        except (ValueError, RuntimeError) as exc:
            raise TopologyError(f"cannot open an event of {peer}: {exc}", peer=peer,
                                phase="init") from None

    def _init_receiver(self) -> None:
        replies: dict[int, HelloMsg] = {}
        offers: list[bool] = []
        for s in range(self._world):
            peer = f"trainer rank {s}"
            msg = self._rx_pop[s].pop(peer=peer, phase="init")
            if not isinstance(msg, HelloMsg) or msg.stream != s or msg.rank != self._rank:
                raise TopologyError(f"expected the buffer descriptors, got {msg.kind!r}",
                                    peer=peer, phase="init")
            n = msg.num_slots
            events = len(msg.handles) == 2 * n + 1  # the trainer orders by events
            if msg.bucket_size != self.config.bucket_size or n < 1 \
                    or len(msg.handles) not in (n, 2 * n + 1):
                raise TopologyError(
                    f"trainer uses bucket_size={msg.bucket_size} with {msg.num_slots} slots, "
                    f"this rollout engine bucket_size={self.config.bucket_size}; configure "
                    "both sides alike", peer=peer, phase="init")
            self._rx_bufs[s] = [self._open(d, msg.bucket_size, peer) for d in msg.handles[:n]]
            self._rx_region_store[s] = self._rx_pop[s]._store.clone()
            self._clients.append(self._rx_region_store[s])  # closed by _leave
            self._events = events
            if events:
                self._rx_filled[s] = [self._open_event(h, peer) for h in msg.handles[n:]]
                # one per slot, then "done": every read of a sync (the trainer waits for
                # it after the final acknowledgement, which goes out before it completes)
                self._rx_drained[s] = [self._ops.new_event() for _ in range(n + 1)]
            if "link" in msg.segments:   # connected before the hello: the trainer accepts
                if not self._links:
                    self._links = {}
                self._links[s] = Link(socket.AF_UNIX, unix_address(self._token, s), self._token,
                                      self._rank, self.config.timeout, peer=peer)
            self._ackers[s] = _AckPusher(self._links.get(s) or self._rx_push[s],
                                         f"weightsync-ack{self._rank}-s{s}", self.config.timeout)
            mine = tuple(self._ops.event_handle(e) for e in self._rx_drained.get(s, ()))
            replies[s] = HelloMsg(stream=s, rank=self._rank, bucket_size=msg.bucket_size,
                                  num_slots=n, handles=mine)
            offers.append("push" in msg.segments)
        # offers go out at every receive_into only when every trainer takes them (each
        # trainer hears it in the reply; the replies wait for every trainer's hello)
        self._push_rx = self.options.push and self._events and not self.config.checksum \
            and all(offers)
        for s, reply in replies.items():
            if self._push_rx:
                reply = dataclasses.replace(reply, segments=("push",))
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
        self._ring_count = 0
        self._graph_count = 0
        self._clear_refs()
        # the lasting tracker: for the ring or fill programs (asked once per sync)
        ring = self._tracking = self._tracks_lasting()
        if ring:
            self._lasting.begin()
        try:
            report = await super().send_weights(named_tensors, version)
        except BaseException:
            if ring:
                self._lasting.reset()   # a failed sync: trust no storage from before it
            raise
        finally:
            self._clear_refs()
            self._chunk_src = ()
            self._deferred, self._deferred_bytes = [], 0
            self._graph_pairs, self._graph_bytes, self._fill_at = [], 0, (0, 0)
        if ring:
            self._lasting.finish()
        return report

    def _check_usable(self, version: Any) -> None:
        """A sync after a failed one: the ring stream may still wait for a receiver of
        that sync; its slots are refilled only once it is done (bounded)."""
        super()._check_usable(version)
        fence, self._fence = self._fence, None
        if fence is None:
            return
        try:
            self._wait_event(fence, peer="the ring stream of the failed sync", phase="send",
                             version=version)
        except SyncTimeout as exc:
            self._fence = fence
            raise PeerFailed(f"{exc.detail}: its slots cannot be refilled; call "
                             "init_process_group again", peer=exc.peer, phase="send",
                             version=version) from None

    def _tracks_lasting(self) -> bool:
        """Whether sends ask which tensors outlive their item: for the ring stream, for
        fill programs (``"event"`` ordering, no checksum: the bucket is read on the GPU),
        or for pushes."""
        return self._ring is not None or self._push or (
            self.options.fill_graphs and self._events and not self.config.checksum)

    def _pushes_ok(self) -> bool:
        """Pushes need this side's option, event ordering and no checksum."""
        return self.options.push and self.options.sync == "event" and not self.config.checksum

    def _tx_direct_ok(self, state: Any, name: str, tensor: torch.Tensor,
                      dtype: torch.dtype) -> bool:
        """The protocol's per-tensor hook (for a tensor that goes into the buckets): no
        tensor skips them here; decide whether this one is copied on the ring or held for
        the bucket's fill program (see the module doc)."""
        lasting = self._tracking and tensor.device == self._ops.device \
            and tensor.is_contiguous() and dtype == tensor.dtype \
            and self._lasting.lasting(name, tensor, version=state.version)
        self._on_ring = lasting and self._ring is not None
        self._on_graph = lasting and self._ring is None
        self._ring_count += self._on_ring
        self._graph_count += self._on_graph
        return False

    def _report(self, state: Any, seconds: float) -> dict[str, Any]:
        out = super()._report(state, seconds)
        out["ring_tensors"] = self._ring_count   # copied on the ring stream (stream waits)
        out["fill_graph_tensors"] = self._graph_count   # copied by fill programs
        return out

    def _stream_wait(self, stream: Any, event: Any) -> None:
        """``stream`` waits on the GPU for ``event`` (no host wait)."""
        self._ops.wait_event(stream, event)

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
        if not self._on_ring and self._gate[self._filling] != _FREE:
            self._free_on_host(self._filling)   # a ring-ordered slot gets a staged tensor
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
        """A kept tensor's copy is queued on the ring with the next few (a batch of about
        an eighth of a bucket, or at the bucket's end); any other is queued now on the
        caller's stream."""
        if self._on_ring:
            self._deferred.append((dst, src))
            self._deferred_bytes += dst.numel() * dst.element_size()
            if self._deferred_bytes >= self._batch_bytes:
                self._flush_ring()
        elif self._on_graph:     # its bytes outlive the item: held for its batch's program
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
                memory, self._ops.copy_runner(self.options.graph_branches))
        self._ops.run_copies(prog[1], lambda: pairs, self._tx_stream)

    def _flush_fill(self, slot: int) -> None:
        """At a bucket's publish: issue its last held batch (before its "filled" record)."""
        self._issue_fill(slot)
        self._fill_at = (self._fill_at[0] + 1, 0)

    def _flush_ring(self) -> None:
        """Queue the deferred copies on the ring, behind the caller's stream as it is now
        (their tensors' bytes were written before they were yielded)."""
        self._ops.record(self._mark, self._tx_stream)
        self._stream_wait(self._ring, self._mark)
        pending, self._deferred, self._deferred_bytes = self._deferred, [], 0
        if pending:
            self._ops.copy_many(pending, self._ring)

    def _tx_ready(self, slot: int, buf: torch.Tensor, version: Any) -> None:
        if self.config.checksum:  # the checksum reads the bucket on the host right away
            self._sync(self._tx_stream, peer="trainer stream", phase="send", version=version)

    def _tx_done(self, slot: int, version: Any) -> None:
        """The bytes queued for ``slot`` (or the zero-copy tensors) are, or will be, ready."""
        if not self._events:
            self._sync(self._tx_stream, peer="trainer stream", phase="send", version=version)
        elif self._ring is not None and slot < len(self._bufs):
            # the slot's bytes: kept tensors as written so far on the caller's stream, and
            # the staged ones copied there, then the kept ones' copies on the ring
            self._flush_ring()
            self._ops.record(self._filled[slot], self._ring)
        else:
            self._ops.record(self._filled[slot], self._tx_stream)

    def _tx_publish(self, slot: int, msg: BucketMsg) -> None:
        self._flush_fill(slot)
        self._tx_done(slot, msg.version)
        self._tx_control().push_many(self._receiver_boxes(), msg)

    def _tx_wait_free(self, slot: int, state: Any) -> None:
        """Before ``slot`` is refilled: the receivers acknowledged its last bucket; then
        the ring waits for their reads on the GPU if the tensor opening it goes on the
        ring, else the host waits for them."""
        self._filling = slot
        prev = self._slot_bucket.get(slot)
        if prev is None:
            self._gate[slot] = _FREE
            return
        self._await_acks(state, final=False, index=prev)
        if self._on_ring:
            for events in self._drained:
                self._stream_wait(self._ring, events[slot])
            self._gate[slot] = _RING
        else:
            self._free_on_host(slot)

    def _free_on_host(self, slot: int) -> None:
        """The host waits (bounded) until the receivers' reads of ``slot`` are done."""
        for r, events in enumerate(self._drained if self._events else ()):
            self._wait_event(events[slot], peer=f"rollout rank {r}", phase="send",
                             version=self._tx_version)
        self._gate[slot] = _FREE

    def _rx_fetch(self, stream: int, msg: BucketMsg) -> Any:
        bufs = self._rx_bufs[stream]
        ring = msg.slot < len(bufs) and msg.index < REF_INDEX_BASE
        if not ring and not (msg.slot == len(bufs) and msg.index >= REF_INDEX_BASE):
            raise TopologyError(f"slot {msg.slot} / bucket {msg.index} does not exist",
                                peer=f"trainer rank {stream}", phase="receive",
                                version=msg.version)
        if self._events and not self._rx_gpu_waits(msg):
            self._wait_event(self._rx_filled[stream][msg.slot], peer=f"trainer rank {stream}",
                             phase="receive", version=msg.version)
        return bufs[msg.slot] if ring else self._fetch_regions(stream, msg)

    def _rx_gpu_waits(self, msg: BucketMsg) -> bool:
        """Whether the consumer's stream, not the pump's host, waits for this bucket's
        fill (``rx_stream_waits``; a checksum is computed on the host: it needs the bytes)."""
        return self.options.rx_stream_waits and msg.checksum is None

    def _layout(self, stream: int, msg: BucketMsg) -> Any:
        entries = super()._layout(stream, msg)
        if self._events and self._rx_gpu_waits(msg):
            # the consumer iterates on this thread: its stream reads the bucket after the fill
            self._stream_wait(self._ops.current_stream(), self._rx_filled[stream][msg.slot])
        return entries

    def _rx_copy_runner(self) -> Any:
        return self._ops.copy_runner(self.options.graph_branches)

    def _rx_release(self, stream: int, msg: BucketMsg) -> None:
        if msg.index >= REF_INDEX_BASE:
            return  # zero-copy reads finish before the final acknowledgement
        # The consumer reads on its current stream; the ack that follows frees the slot.
        if self._events:
            self._ops.record(self._rx_drained[stream][msg.slot], self._ops.current_stream())
        else:
            self._sync(self._ops.current_stream(), peer=f"rollout rank {self._rank}",
                       phase="receive", version=msg.version)

    def _rx_finish_stream(self, state: Any, stream: int, msg: Any) -> None:
        # Every read (zero-copy ones too) is done before this receive returns. With events,
        # the final acknowledgement goes out first, behind the "done" event recorded after
        # the reads: the trainer waits for that event itself, so the message's trip
        # overlaps the GPU's last copies instead of following them.
        if self._events:
            done = self._rx_drained[stream][-1]
            self._ops.record(done, self._ops.current_stream())
            super()._rx_finish_stream(state, stream, msg)
            self._wait_event(done, peer=f"rollout rank {self._rank}", phase="receive",
                             version=msg.version)
            return
        self._sync(self._ops.current_stream(), peer=f"rollout rank {self._rank}",
                   phase="receive", version=msg.version)
        super()._rx_finish_stream(state, stream, msg)

    def _finish_stream(self, state: Any) -> None:
        super()._finish_stream(state)        # every receiver acknowledged the end ...
        for r, events in enumerate(self._drained if self._events else ()):
            # ... and, with events, its reads are done (it acknowledges before they are)
            self._wait_event(events[-1], peer=f"rollout rank {r}", phase="send",
                             version=state.version)

    def _abort_send(self, state: Any, exc: BaseException) -> None:
        if self._ring is not None:   # the next sync refills slots only once this is done
            self._fence = self._fence or self._ops.new_event()
            self._ops.record(self._fence, self._ring)
        super()._abort_send(state, exc)

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
        self._ring = self._mark = self._fence = None   # slots kept until the ring is done
        if self._hub is not None:
            self._hub.close()
        for link in self._links.values():
            link.close()
        self._hub, self._links = None, {}
        self._gate = []
        self._lasting.reset()
        self._rx_regions, self._rx_used, self._rx_region_store = {}, {}, {}
        self._regions = {}
        self._region_store = None
        self._clear_refs()
        self._release_push()
        self._ops.collect()
        self._leave()

    def finalize(self) -> None:
        self._release()
        self.close_server()
