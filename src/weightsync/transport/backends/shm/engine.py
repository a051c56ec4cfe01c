"""``shm``: trainer and rollout processes on one host, through shared memory.

Each trainer rank owns a ring of ``num_slots`` shared-memory buckets, allocated and
pre-faulted once in ``init_process_group`` and reused by every sync. The trainer fills
bucket k+1 while the rollout ranks copy out of bucket k; a slot is refilled only after
every rollout rank acknowledged the bucket it held, so a buffer is never overwritten
while someone reads it. Rollout ranks get views straight into the shared buckets (the
consumer's copy into its model is the only copy on their side). Waiting is blocking on a
socket, never spinning. Segments are unlinked as soon as all readers mapped them.

Speed: per-bucket headers and acks travel on one Unix socket per
receiver (:mod:`weightsync.transport.control.links`), not through the control store.
Where the kernel lets rollout ranks read the trainer's memory (``process_vm_readv``,
probed in ``init_process_group``), every contiguous tensor of at least
``direct_min_bytes`` (8 MiB) skips the ring: the trainer sends its
address and waits until every receiver has read it (the tensor is valid only until the
next item), so one copy remains instead of two. A tensor whose bytes outlive the item
(a parameter: marked by the export, or the same storage under one name since the last
sync, :class:`~weightsync.transport.tensors.LastingStorage`) is not waited for: up to
:data:`~weightsync.transport.protocol.sender.DIRECT_WINDOW` such tensors are unread at a
time, so receivers read one while the trainer asks its iterator for the next; with
``receive_into`` that copy lands straight in the receiver's own tensor. Copies use
``memmove`` rather than torch's thread pool (:mod:`weightsync.transport.fastcopy`).
``direct`` (:class:`ShmOptions`, ``WEIGHTSYNC_SHM_DIRECT``): ``"auto"`` (default: only
while every receiver has two cores, or there is one receiver), ``True`` always, ``False``
never.

A CPU trainer whose tensors live in torch's shared memory (``model.share_memory()``, once)
lets receivers map them: a direct tensor of such a storage is copied with ``memcpy`` out
of the mapping (split over the receiver's copy threads) instead of read through the
kernel, as fast as a local copy (:mod:`weightsync.transport.peermem`; mappings are kept
between syncs, at most one sync's tensors). Where a receiver may not open the trainer's
descriptors it reads as before.

A receiver whose own tensors live in torch's shared memory (a CPU rollout engine that
called ``model.share_memory()``) offers them at the start of every ``receive_into``
(a ``LandMsg`` to every trainer rank): a tensor every receiver offered with its exact
shape and dtype is then written by the trainer straight into their memory (one copy; a
GPU trainer copies device-to-host straight into it, the mapping registered as pinned)
and named to the receivers once the copies are done, before the sync's end; it takes no
bucket. The trainer writes only during that receive, never into memory an engine is
using. The trainer keeps its mappings while the offers stay the same (a GPU trainer's
registration of a big model as pinned memory costs about a second); memory a receiver
freed (sleep level 2, new tensors) stays allocated until the trainer's next sync drops
the mappings of offers no longer made.

GPU trainers: CUDA tensors are copied device-to-host into the ring. When the trainer
process has CUDA initialized it registers its segments as pinned host memory
(``cudaHostRegister``) so those copies run asynchronously at the link's full speed; a
bucket that got any is published only once the copies queued on the trainer's current
stream are done (an event polled, bounded by the timeout).

Lifecycle (per worker): ``prepare`` (trainers start their control store) ->
``build_topology`` -> ``init_process_group`` (trainers create the ring, rollout ranks map
it) -> any number of ``send_weights``/``receive_weights`` -> ``finalize``.

This module owns the shm data path (segments, links, the direct-read probe); the bucket
protocol is :mod:`weightsync.transport.protocol`. Created by name through
``CheckpointEngineRegistry`` (registered lazily in :mod:`weightsync.transport`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import math
import os
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from weightsync.core.errors import PeerFailed, PlanMismatch, SyncTimeout, TopologyError
from weightsync.core.plan import dtype_name
from weightsync.core.remote import raise_remote, wire_version
from weightsync.core.wire import (DIRECT_BASE, PUSHED_SLOT, BucketMsg, ErrorMsg, HelloMsg,
                                  LandMsg)
from weightsync.transport.tensors import plain_cpu
from weightsync.transport.protocol.sender import (DIRECT_WINDOW, BucketedEngine, DirectTensors,
                                                 wait_stream)
from weightsync.transport.control.links import Link, LinkHub, unix_address
from weightsync.transport.fastcopy import (cma_available, cma_read, copy_threads, memmove_from,
                                           split_memmove)
from weightsync.transport.peermem import PeerMaps, shared_ref
from weightsync.core.config import option, parse_bool
from weightsync.core.plan import TensorMeta, itemsize
from weightsync.transport.control.group import StoreGroupMixin
from weightsync.transport.protocol.receiver import ReceiverMixin
from weightsync.transport.backends.shm.segments import Segment, sweep_stale
from weightsync.transport.registry import CheckpointEngineRegistry

__all__ = ["ShmEngine", "ShmOptions", "SPLIT_MIN_THREADS", "SPLIT_BYTES", "DIRECT_MIN"]

logger = logging.getLogger(__name__)

#: A receiver splits bucket copies of at least SPLIT_BYTES over its copy threads when it
#: has this many (``WEIGHTSYNC_COPY_THREADS``, default min(4, cores)): with 2 cores, the
#: trainer's own copy and the reader share them, and one thread each is faster.
SPLIT_MIN_THREADS, SPLIT_BYTES = 3, 8 << 20
#: ``direct_min_bytes``'s default: contiguous CPU tensors this big skip the ring.
DIRECT_MIN = 8 << 20


def _auto_bool(raw: Any) -> Union[bool, str]:
    """``"auto"``, else a bool (``1/true/yes/on``, ``0/false/no/off``)."""
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        return "auto"
    return parse_bool(raw) if isinstance(raw, str) else raw


@dataclass(kw_only=True)
class ShmOptions:
    """Options of ``shm`` beyond :class:`~weightsync.core.config.EngineConfig`.

    Keyword arguments of the engine (``connect("shm", ..., direct=False)``) or one object
    (``options=ShmOptions(...)``). A field left out comes from its ``WEIGHTSYNC_*``
    variable, read when the options are built, else from its default.
    """

    direct: Union[bool, str] = option(
        "SHM_DIRECT", _auto_bool, "auto",
        "Big CPU tensors skip the ring and are read from the trainer's memory: True, False "
        "or \"auto\" (while every receiver has two cores, or there is one receiver).")
    direct_min_bytes: int = option(
        None, int, DIRECT_MIN,
        "Contiguous CPU tensors of at least this many bytes go direct when direct reads are on.")
    copy_threads: Optional[int] = option(
        "COPY_THREADS", int, None,
        "Threads a receiver splits big copies over (1 to 64); None: the host's cores shared "
        "by its receivers, at most 16.")

    def __post_init__(self) -> None:
        try:
            direct = _auto_bool(self.direct)
        except ValueError:
            direct = None
        if not (isinstance(direct, bool) or direct == "auto"):
            raise ValueError(f"direct must be True, False or 'auto', got {self.direct!r}")
        self.direct = direct
        if isinstance(self.direct_min_bytes, bool) or not isinstance(self.direct_min_bytes, int) \
                or self.direct_min_bytes < 1:
            raise ValueError(f"direct_min_bytes must be an int >= 1, got "
                             f"{self.direct_min_bytes!r}")
        n = self.copy_threads
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64):
            raise ValueError(f"copy_threads must be an int from 1 to 64 or None, got {n!r}")


def _cuda_in_use() -> bool:
    """Whether this process uses CUDA (its segments are then registered as pinned)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@CheckpointEngineRegistry.register("shm")
class ShmEngine(StoreGroupMixin, ReceiverMixin, DirectTensors, BucketedEngine):
    """Same-host, multi-process transport over shared memory."""

    capabilities = frozenset({"cpu", "same_host"})
    options_cls = ShmOptions
    options: ShmOptions
    _direct_window = DIRECT_WINDOW

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if torch.device(self.config.device).type != "cpu":
            raise ValueError("shm moves CPU tensors; use cuda_ipc or collective for GPUs")
        self._segments: list[Segment] = []
        self._rx_segments: dict[int, list[Segment]] = {}
        self._hub: Optional[LinkHub] = None
        self._links: dict[int, Link] = {}
        self._peer_pid: dict[int, int] = {}
        self._direct = False
        self._copy_threads = copy_threads(threads=self.options.copy_threads)
        self._copy_pool: Optional[ThreadPoolExecutor] = None
        self._direct_min = self.options.direct_min_bytes
        self._pinned: list[int] = []          # data pointers registered with CUDA
        self._d2h: Any = None   # the stream of the open bucket's device-to-host copies
        self._split = False     # receiver: big bucket copies go over the copy threads
        self._peer_maps = PeerMaps()
        # pushes into receivers' shared tensors (see the module doc)
        self._push = False          # trainer: every receiver offers landings each sync
        self._push_rx = False       # receiver: the trainer was told we send them
        self._land_sent: dict[int, str] = {}            # receiver: digest sent per stream
        self._landings: dict[int, dict[str, tuple]] = {}   # trainer: per receiver rank
        self._land_digest: dict[int, str] = {}
        self._land_early: dict[tuple[int, int], LandMsg] = {}   # (seq, rank) -> message
        self._push_key: Optional[tuple] = None
        self._push_dests: dict[str, tuple] = {}   # name -> (shape, dtype, [bytes per rank])
        self._pushed: list[TensorMeta] = []
        self._pushed_n = 0
        self._tx_maps: Optional[PeerMaps] = None
        self._tx_pinned: dict[int, bool] = {}

    def _init_sender(self) -> None:
        sweep_stale()
        size, n = self.config.bucket_size, self.config.num_slots
        self._segments = [Segment(Segment.make_name(self._token, self._rank, i), size,
                                  create=True) for i in range(n)]
        self._pin_segments()
        hello = HelloMsg(stream=self._rank, rank=0, bucket_size=size, num_slots=n,
                         segments=tuple(s.name for s in self._segments))
        self._hub = LinkHub(socket.AF_UNIX, unix_address(self._token, self._rank),
                            self._token, self.config.timeout)
        try:
            self._tx_inbox.push_many(self._receiver_boxes(), hello)
            attached = set()
            deadline = time.monotonic() + self.config.timeout
            while len(attached) < self._num_receivers:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self._num_receivers)) - attached)
                    raise SyncTimeout(f"rollout ranks {missing} did not map the buffers",
                                      peer=f"rollout rank {missing[0]}", phase="init")
                msg = self._tx_inbox.pop(timeout=left, peer="rollout ranks", phase="init")
                if isinstance(msg, HelloMsg):
                    attached.add(msg.rank)
            self._hub.accept(self._num_receivers, deadline)
            self._direct = self._probe_direct(deadline)
        finally:
            for seg in self._segments:
                seg.unlink()

    def _probe_direct(self, deadline: float) -> bool:
        """Can every receiver read this process's memory (cross-memory attach)? Each one
        reads random bytes at an address sent on its link and reports what it saw."""
        probe = torch.frombuffer(bytearray(secrets.token_bytes(32)), dtype=torch.uint8)
        want = probe.numpy().tobytes().hex()
        hello = HelloMsg(stream=self._rank, rank=0, bucket_size=self.config.bucket_size,
                         num_slots=self.config.num_slots, segments=(want,))
        self._hub.push_many(self._receiver_boxes(), hello, aux=probe.data_ptr())
        ok, push, replied = set(), set(), set()
        while len(replied) < self._num_receivers:
            missing = sorted(set(range(self._num_receivers)) - replied)
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncTimeout(f"rollout ranks {missing} did not answer the memory probe",
                                  peer=f"rollout rank {missing[0]}", phase="init")
            msg = self._hub.pop(timeout=left, peer=f"rollout rank {missing[0]}", phase="init")
            if isinstance(msg, HelloMsg):
                replied.add(msg.rank)
                if "cma" in msg.segments:
                    ok.add(msg.rank)
                if "push" in msg.segments:
                    push.add(msg.rank)
            elif isinstance(msg, LandMsg):
                # a receiver done with its init already began its first receive: its offer
                # is for that sync (the probe waits on for the others' answers)
                self._land_early[(msg.seq, msg.rank)] = msg
            elif isinstance(msg, ErrorMsg):
                raise_remote(msg, phase="init")
        # pushes: every receiver offers landings each sync, and opening a receiver's
        # descriptors takes the same permission as reading its memory
        self._push = len(push) == len(ok) == self._num_receivers and not self.config.checksum
        if not self._push:
            self._land_early.clear()
        direct = self.options.direct
        return direct is not False and len(ok) == self._num_receivers \
            and not self.config.checksum and (direct is True or self._direct_pays())

    def _direct_pays(self) -> bool:
        """``auto``: direct reads win while every receiver has cores to read with; with
        more receivers than that, their concurrent reads and the per-tensor wait for the
        slowest one cost more than the ring's extra copy."""
        return self._num_receivers == 1 or 2 * self._num_receivers <= (os.cpu_count() or 1)

    def _init_receiver(self) -> None:
        for s in range(self._world):
            msg = self._rx_pop[s].pop(peer=f"trainer rank {s}", phase="init")
            if not isinstance(msg, HelloMsg) or msg.stream != s:
                raise TopologyError(f"expected the buffer layout, got {msg.kind!r}",
                                    peer=f"trainer rank {s}", phase="init")
            if msg.bucket_size != self.config.bucket_size or msg.num_slots != len(msg.segments):
                raise TopologyError(
                    f"trainer uses bucket_size={msg.bucket_size}, this rollout engine "
                    f"{self.config.bucket_size}; configure both sides alike",
                    peer=f"trainer rank {s}", phase="init")
            self._rx_segments[s] = [Segment(name, msg.bucket_size, create=False)
                                    for name in msg.segments]
            peer = f"trainer rank {s}"
            link = Link(socket.AF_UNIX, unix_address(self._token, s), self._token, self._rank,
                        self.config.timeout, peer=peer)
            self._links[s] = link
            self._rx_push[s].push("t", HelloMsg(stream=s, rank=self._rank,
                                                bucket_size=msg.bucket_size,
                                                num_slots=msg.num_slots))
            self._peer_pid[s] = link.peer_pid()
            probe = link.pop(peer=peer, phase="init")
            ok = False
            if isinstance(probe, HelloMsg) and len(probe.segments) == 1:
                try:
                    want = bytes.fromhex(probe.segments[0])
                    ok = cma_available(self._peer_pid[s], link.last_aux, want)
                except ValueError:
                    ok = False
            self._push_rx = True
            link.push("t", HelloMsg(stream=s, rank=self._rank, bucket_size=msg.bucket_size,
                                    num_slots=msg.num_slots,
                                    segments=(("cma",) if ok else ()) +
                                    (("push",) if self._push_rx else ())))
            # split bucket copies while every receiver has the cores: unless set, the copy
            # threads are this host's cores shared by the receivers (all on this host)
            self._copy_threads = n = copy_threads(max(1, self._num_receivers),
                                                  threads=self.options.copy_threads)
            self._split = n >= SPLIT_MIN_THREADS and \
                n * max(1, self._num_receivers) <= (os.cpu_count() or 1)
            if (ok or self._split) and self._copy_pool is None and n > 1:
                self._copy_pool = ThreadPoolExecutor(self._copy_threads - 1,
                                                     thread_name_prefix="weightsync-copy")

    def _pin_segments(self) -> None:
        """Register the ring as pinned host memory for a GPU trainer (see the module doc)."""
        if not _cuda_in_use():
            return
        cudart = torch.cuda.cudart()
        for seg in self._segments:
            t = seg.tensor
            err = cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0)
            if int(err) != 0:   # not fatal: the copies stay synchronous, as unpinned
                logger.warning("shm: cudaHostRegister of a %d-byte segment failed (%s); "
                               "device-to-host copies will not overlap", t.numel(), err)
                continue
            self._pinned.append(t.data_ptr())

    def _unpin_segments(self) -> None:
        if self._pinned:
            cudart = torch.cuda.cudart()
            for ptr in self._pinned:
                cudart.cudaHostUnregister(ptr)
        self._pinned = []

    def _copy_piece(self, buf: torch.Tensor, meta: TensorMeta, tensor: torch.Tensor,
                    dtype: torch.dtype) -> None:
        if tensor.device.type == "cuda":
            self._d2h = torch.cuda.current_stream(tensor.device)   # the caller's stream
        BucketedEngine._copy_piece(buf, meta, tensor, dtype)

    def _tx_ready(self, slot: int, buf: torch.Tensor, version: Any) -> None:
        """A bucket with device-to-host copies is complete once the caller's stream ran
        them (asynchronous into pinned segments)."""
        if self._d2h:
            stream, self._d2h = self._d2h, None
            wait_stream(stream, self.config.timeout, peer="trainer stream", phase="send",
                        version=version)

    # -- data path ------------------------------------------------------------------------
    def _tx_buffer(self, slot: int) -> torch.Tensor:
        return self._segments[slot].tensor

    def _tx_publish(self, slot: int, msg: BucketMsg) -> None:
        self._tx_control().push_many(self._receiver_boxes(), msg)

    def _tx_wait_free(self, slot: int, state: Any) -> None:
        prev = self._slot_bucket.get(slot)
        if prev is not None:
            self._await_acks(state, final=False, index=prev)

    def _rx_fetch(self, stream: int, msg: BucketMsg) -> torch.Tensor:
        segs = self._rx_segments[stream]
        if msg.slot >= len(segs):
            raise TopologyError(f"slot {msg.slot} does not exist", peer=f"trainer rank {stream}",
                                phase="receive", version=msg.version)
        return segs[msg.slot].tensor

    def _rx_release(self, stream: int, msg: BucketMsg) -> None:
        pass  # the acknowledgement the protocol sends frees the slot

    def _land(self, dest: torch.Tensor, buf: torch.Tensor, offset: int, nbytes: int) -> None:
        """Big copies out of a bucket run on the copy threads too, where there are enough
        (a GPU trainer fills the ring at PCIe speed, faster than one thread copies out)."""
        pool, n = self._copy_pool, self._copy_threads
        if not self._split or pool is None or nbytes < SPLIT_BYTES:
            memmove_from(dest, buf, offset, nbytes)
            return
        flat = dest.view(-1).view(torch.uint8) if dest.dim() else dest.reshape(1).view(torch.uint8)
        step = -(-nbytes // n)
        jobs = [pool.submit(memmove_from, flat[k:k + step], buf, offset + k,
                            min(step, nbytes - k)) for k in range(step, nbytes, step)]
        memmove_from(flat[:step], buf, offset, min(step, nbytes))
        deadline = time.monotonic() + self.config.timeout
        try:
            for job in jobs:
                job.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise SyncTimeout(f"copying {nbytes} bytes out of a bucket took over "
                              f"{self.config.timeout:.0f}s", peer=f"rollout rank {self._rank}",
                              phase="receive") from None

    # -- direct tensors (DirectTensors): receivers read the trainer's memory (one copy) ----
    def _direct_on(self) -> bool:
        return self._direct          # every receiver can read us (probed), no checksums

    def _direct_deliver(self, state: Any, msg: BucketMsg, tensor: torch.Tensor) -> None:
        ref = shared_ref(tensor)
        if ref is not None:     # receivers may map it; the address stays for those who cannot
            msg = dataclasses.replace(msg, shared=ref)
        self._hub.push_many(self._receiver_boxes(), msg, aux=tensor.data_ptr())
        self._await_direct(state, msg)

    def _rx_direct(self, stream: int, msg: BucketMsg, aux: int, dest: torch.Tensor) -> None:
        if msg.shared is not None and self._rx_mapped(stream, msg, dest):
            return
        try:
            cma_read(self._peer_pid[stream], aux, dest, self._copy_pool, self._copy_threads)
        except (OSError, KeyError) as exc:
            raise PeerFailed(f"could not read tensor {msg.entries[0].name!r} from the trainer "
                             f"({exc})", peer=f"trainer rank {stream}", phase="receive",
                             version=msg.version) from None

    def _rx_mapped(self, stream: int, msg: BucketMsg, dest: torch.Tensor) -> bool:
        """Copy a direct tensor out of the trainer's shared storage, mapped here; False
        when it cannot be (the caller reads it through the kernel instead)."""
        storage = self._peer_maps.view(self._peer_pid[stream], msg.shared)
        offset, nbytes = msg.shared[3], msg.nbytes
        if storage is None or offset + nbytes > storage.numel() or not dest.is_contiguous() \
                or dest.numel() * dest.element_size() != nbytes:
            return False
        split_memmove(dest.data_ptr(), storage.data_ptr() + offset, nbytes,
                      self._copy_pool, self._copy_threads)
        return True

    def _rx_finish_stream(self, state: Any, stream: int, msg: Any) -> None:
        super()._rx_finish_stream(state, stream, msg)
        if not state.remaining:      # the sync is complete: unmap what it did not use
            self._peer_maps.end_sync()

    # -- pushes: the trainer writes straight into receivers' shared tensors -------------
    def _rx_begin(self, state: Any) -> None:
        """Receiver: offer the trainers this receive's shared destination tensors."""
        if not self._push_rx:
            return
        landings = []
        for name, t in (state.into or {}).items():
            ref = shared_ref(t) if isinstance(t, torch.Tensor) else None
            if ref is not None:
                landings.append((name, tuple(t.shape), dtype_name(t.dtype)) + ref)
        landings = tuple(landings)
        digest = hashlib.blake2b(repr(landings).encode(), digest_size=16).hexdigest()
        for s, link in self._links.items():
            same = self._land_sent.get(s) == digest
            link.push("t", LandMsg(seq=state.seq, rank=self._rank, digest=digest,
                                   landings=None if same else landings))
            self._land_sent[s] = digest

    def _tx_stash(self, msg: Any) -> None:
        if self._push and isinstance(msg, LandMsg):     # the next sync's offer
            self._land_early[(msg.seq, msg.rank)] = msg

    async def _tx_begin(self, state: Any) -> None:
        self._pushed, self._pushed_n = [], 0
        if self._push:
            await self._blocking(self._await_landings, state)

    def _await_landings(self, state: Any) -> None:
        """Trainer: every receiver's offer for this sync (sent when its receive began)."""
        key = self._collect_offers(state)
        if key != self._push_key:
            self._push_key = None
            self._push_dests = self._map_landings()
            self._push_key = key

    def _map_landings(self) -> dict[str, tuple]:
        """Map the tensors every receiver offered alike: name -> (shape, dtype, views)."""
        if self._tx_maps is None:
            self._tx_maps = PeerMaps(writable=True, on_map=self._pin_mapping,
                                     on_drop=self._unpin_mapping)
        ranks = range(self._num_receivers)
        first = self._landings.get(0, {})
        dests: dict[str, tuple] = {}
        for name, (_, shape, dtype, *ref) in first.items():
            views = []
            for r in ranks:
                entry = self._landings.get(r, {}).get(name)
                if entry is None or entry[1] != shape or entry[2] != dtype:
                    break
                storage = self._tx_maps.view(self._hub.peer_pid(r), tuple(entry[3:]))
                if storage is None:
                    break
                offset = entry[6]
                views.append(storage[offset:offset + math.prod(shape) * itemsize(dtype)])
            else:
                dests[name] = (shape, dtype, views)
        self._tx_maps.end_sync()     # drop the mappings of offers no longer made
        return dests

    def _pin_mapping(self, mapped: torch.Tensor) -> None:
        """A GPU trainer registers a receiver's mapped memory as pinned (asynchronous
        device-to-host copies at the link's speed), as it does its ring."""
        if _cuda_in_use() and mapped.numel():
            err = torch.cuda.cudart().cudaHostRegister(mapped.data_ptr(), mapped.numel(), 0)
            self._tx_pinned[mapped.data_ptr()] = int(err) == 0
            if int(err) != 0:
                logger.warning("shm: cudaHostRegister of a receiver's %d bytes failed (%s); "
                               "copies into it will not overlap", mapped.numel(), err)

    def _unpin_mapping(self, mapped: torch.Tensor) -> None:
        if self._tx_pinned.pop(mapped.data_ptr(), False):
            torch.cuda.cudart().cudaHostUnregister(mapped.data_ptr())

    def _tx_push(self, state: Any, name: str, tensor: torch.Tensor,
                 dtype: torch.dtype) -> bool:
        found = self._push_dests.get(name) if self._push else None
        if found is None:
            return False
        shape, wire, views = found
        if tuple(tensor.shape) != shape or dtype_name(dtype) != wire:
            return False
        nbytes = views[0].numel()
        for dst in views:
            if tensor.device.type == "cuda":
                self._d2h = torch.cuda.current_stream(tensor.device)
                dst.view(dtype).view(shape).copy_(tensor, non_blocking=True)
            elif plain_cpu(tensor) and tensor.dtype == dtype:
                split_memmove(dst.data_ptr(), tensor.data_ptr(), nbytes, *self._push_pool())
            else:
                dst.view(dtype).view(shape).copy_(tensor)
        self._pushed.append(TensorMeta(name, shape, wire, 0, nbytes, 0, nbytes))
        state.tensors += 1
        state.nbytes += nbytes
        return True

    def _push_pool(self) -> tuple[Optional[ThreadPoolExecutor], int]:
        """Copy threads for a CPU trainer's big pushes (the receivers wait meanwhile: the
        host's cores are free; ``copy_threads``, else min(4, cores))."""
        n = self.__dict__.get("_push_threads")
        if n is None:
            n = self._push_threads = copy_threads(threads=self.options.copy_threads)
            if n > 1:
                self._copy_pool = ThreadPoolExecutor(n - 1, thread_name_prefix="weightsync-push")
        return self._copy_pool, n

    def _finish_stream(self, state: Any) -> None:
        """Name what was written into the receivers' memory (once it is there), then end."""
        if self._pushed:
            if self._d2h:
                stream, self._d2h = self._d2h, None
                wait_stream(stream, self.config.timeout, peer="trainer stream", phase="send",
                            version=state.version)
            msg = BucketMsg(version=wire_version(state.version), seq=state.seq,
                            stream=self._rank, index=DIRECT_BASE, slot=PUSHED_SLOT,
                            nbytes=sum(m.nbytes for m in self._pushed), layout="pushed",
                            entries=tuple(self._pushed))
            self._pushed_n, self._pushed = len(self._pushed), []
            self._hub.push_many(self._receiver_boxes(), msg)
        super()._finish_stream(state)

    def _report(self, state: Any, seconds: float) -> dict[str, Any]:
        report = super()._report(state, seconds)
        report["pushed"], self._pushed_n = self._pushed_n, 0
        return report

    # -- teardown -------------------------------------------------------------------------
    def _release(self) -> None:
        self._stop_threads()
        self._unpin_segments()
        for seg in self._segments:
            seg.close()
        for segs in self._rx_segments.values():
            for seg in segs:
                seg.close()
        self._segments, self._rx_segments = [], {}
        if self._hub is not None:
            self._hub.close()
        for link in self._links.values():
            link.close()
        self._hub, self._links, self._peer_pid, self._direct = None, {}, {}, False
        self._peer_maps.close()
        if self._tx_maps is not None:
            self._tx_maps.close()
        self._tx_maps, self._push_key, self._push_dests = None, None, {}
        self._landings, self._land_digest, self._land_early = {}, {}, {}
        self._land_sent, self._push, self._push_rx = {}, False, False
        self.__dict__.pop("_push_threads", None)
        self.__dict__.pop("_staging_pool", None)
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=True)
            self._copy_pool = None
        self._leave()

    def finalize(self) -> None:
        self._release()
        self.close_server()
