"""Zero-copy half of ``cuda_ipc``: receivers read tensors straight from the trainer's memory.

With ``zero_copy`` (the default), a contiguous CUDA tensor on the trainer's device (no
cast) whose bytes outlive its item (:class:`~weightsync.transport.tensors.ReplayedLasting`:
a parameter, or a view of storage the export reuses for the same name, from the second
sync on; a tensor the export marked with ``mark_stable`` from the first) is not packed
into a bucket: the trainer exports its *storage* once (a *region*, descriptors in the
trainer's control store, one reference per receiver) and announces batches of ``(name,
shape, dtype, region << 40 | byte offset)`` entries as buckets of their own (indices from
``REF_INDEX_BASE``, slot ``num_slots``; their layouts are replayed like ring buckets).
Receivers map each region once and hand out views into it. A batch announced while the
trainer's stream has nothing left to run is read at once; one announced behind pending
work is read after an event recorded behind it. Any other tensor (a temporary,
a buffer the export refills for several names) goes through the ring, so the export may
free or rewrite it once the iterator moves on. Regions not used in a sync are released by
both sides at its end. The tensors must stay unchanged until ``send_weights`` returns;
the engine keeps them referenced until then.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from weightsync.core.errors import PlanMismatch, SyncTimeout
from weightsync.core.plan import Bucket, TensorMeta, bucket_digest, dtype_name
from weightsync.core.wire import BucketMsg, HelloMsg, decode, encode
from weightsync.core.remote import wire_version
from weightsync.transport.tensors import same_view, view_record, wire_dtype

__all__ = ["ZeroCopyMixin", "REF_INDEX_BASE", "REGION_SHIFT", "MAX_REF_ENTRIES"]

logger = logging.getLogger(__name__)

#: Bucket indices of zero-copy batches start here (acks never collide with ring buckets).
REF_INDEX_BASE = 1 << 40
#: A zero-copy entry's ``offset`` is ``region_id << REGION_SHIFT | byte offset``.
REGION_SHIFT = 40
#: Most entries one zero-copy announcement carries.
MAX_REF_ENTRIES = 1024


@dataclass
class _Region:
    rid: int
    weak: StorageWeakRef


class _RegionView:
    """Stands in for a bucket buffer: slices ``[rid << 40 | offset : ...]`` map to regions."""

    __slots__ = ("regions", "device")

    def __init__(self, regions: dict[int, torch.Tensor], device: torch.device) -> None:
        self.regions = regions
        self.device = device

    def key(self, entries: tuple[TensorMeta, ...]) -> tuple:
        """The regions ``entries`` read and their addresses (what a replayed copy program
        reads; regions mapped for other batches do not change it)."""
        rids = sorted({e.offset >> REGION_SHIFT for e in entries})
        return tuple((rid, self.regions[rid].data_ptr()) for rid in rids)

    def __getitem__(self, key: slice) -> torch.Tensor:
        rid, local = divmod(key.start, 1 << REGION_SHIFT)
        return self.regions[rid][local: local + (key.stop - key.start)]


class ZeroCopyMixin:
    """Zero-copy sending and receiving for :class:`~weightsync.transport.backends.cuda_ipc.engine.CudaIpcEngine`
    (which provides ``options``, ``_ops``, ``_bufs``, ``_tx_done``, ``_open`` and the
    control channels)."""

    #: the ring's buckets are numbered below the zero-copy batches
    _rx_bucket_index_end = REF_INDEX_BASE

    def _init_refs(self) -> None:
        self._region_store: Any = None
        self._regions: dict[tuple, _Region] = {}
        self._next_rid = 0
        self._tx_ref_plan: list[tuple[Bucket, str]] = []         # (batch, its digest)
        self._rx_ref_plans: dict[int, list[tuple[Bucket, str]]] = {}
        self._rx_regions: dict[int, dict[int, torch.Tensor]] = {}
        self._rx_used: dict[int, set[int]] = {}
        self._rx_batches: dict[int, int] = {}     # zero-copy batches of this sync
        self._rx_region_store: dict[int, Any] = {}
        self._ref_prev: list = []  # per tensor of the last sync: its cached entry, or None
        self._asked: Optional[tuple] = None   # (tensor, whether it outlives its item)
        self._clear_refs()

    def _layout(self, stream: int, msg: BucketMsg) -> tuple[TensorMeta, ...]:
        if msg.index < REF_INDEX_BASE:
            return super()._layout(stream, msg)
        return self._ref_layout(stream, msg)

    # -- zero-copy: sender --------------------------------------------------------------------
    def _clear_refs(self) -> None:
        self._ref_entries: list[TensorMeta] = []
        self._ref_hold: list[torch.Tensor] = []
        self._ref_bytes = 0
        self._ref_plan_new: list[tuple[Bucket, str]] = []
        self._ref_used: set[int] = set()
        self._ref_stats = [0, 0]  # tensors, bytes
        self._ref_pos = 0
        self._ref_seen: list = []

    def _can_ref(self, tensor: torch.Tensor) -> bool:
        return (self.options.zero_copy and not self.config.checksum
                and tensor.device == self._ops.device
                and wire_dtype(tensor, self.config.dtype) == tensor.dtype
                and tensor.numel() > 0
                and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg())

    def _replayed(self, name: str, tensor: torch.Tensor) -> Optional[tuple]:
        """The entry of the last sync at this position if it is the same tensor (name,
        address, shape and dtype, over the same storage, still alive: the very object, or
        a new view of it as FSDP2's reused buffers and merged-LoRA exports yield): then
        nothing about it needs to be worked out."""
        pos = self._ref_pos
        self._ref_pos += 1
        prev = self._ref_prev[pos] if pos < len(self._ref_prev) else None
        if prev is not None and tensor.is_contiguous() and same_view(prev[0], name, tensor):
            return prev
        return None

    def _ask_lasting(self, state: Any, name: str, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes outlive its item (asked once per tensor and sync, in
        order; the answer is kept for the ring's own hook, :meth:`_tx_direct_ok`)."""
        ok = self._tracking and tensor.device == self._ops.device and tensor.is_contiguous() \
            and wire_dtype(tensor, self.config.dtype) == tensor.dtype \
            and self._lasting.lasting(name, tensor, version=state.version)
        self._asked = (tensor, ok)
        return ok

    async def _pack(self, state: Any, name: str, tensor: torch.Tensor) -> None:
        prev = self._replayed(name, tensor) if self.options.zero_copy else None
        lasting = self._ask_lasting(state, name, tensor)
        if prev is not None and lasting:
            meta = prev[1]
            self._ref_used.add(meta.offset >> REGION_SHIFT)
        elif not (lasting and self._can_ref(tensor)):
            self._ref_seen.append(None)
            await super()._pack(state, name, tensor)
            return
        else:
            meta = await self._new_ref(name, tensor)
            prev = (view_record(name, tensor), meta)
        self._ref_seen.append(prev)
        nbytes = meta.nbytes
        self._ref_entries.append(meta)
        self._ref_hold.append(tensor)
        self._ref_bytes += nbytes
        self._ref_stats[0] += 1
        self._ref_stats[1] += nbytes
        state.tensors += 1
        state.nbytes += nbytes
        # The first batch goes out early; each next one doubles, so a sync sends few
        # messages (a fixed cap means more messages, each a host round trip).
        first = max(1, self.config.bucket_size)
        limit = first << min(len(self._ref_plan_new), 20)
        if self._ref_bytes >= limit or len(self._ref_entries) >= MAX_REF_ENTRIES:
            await self._blocking(self._publish_refs, state)

    async def _new_ref(self, name: str, tensor: torch.Tensor) -> TensorMeta:
        rid = self._known_region(tensor)
        if rid is None:  # first use of this storage: export it (blocking store calls)
            rid = await self._blocking(self._export_region, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        offset = (rid << REGION_SHIFT) + tensor.storage_offset() * tensor.element_size()
        return TensorMeta(name, tuple(tensor.shape), dtype_name(tensor.dtype), offset, nbytes,
                          0, nbytes)

    def _region_key(self, rid: int, receiver: int) -> str:
        return f"{self._prefix(self._rank)}/region/{rid}/r{receiver}"

    @staticmethod
    def _storage_key(tensor: torch.Tensor) -> tuple[Any, tuple]:
        storage = tensor.untyped_storage()
        return storage, (storage._cdata, storage.data_ptr(), storage.nbytes())

    def _known_region(self, tensor: torch.Tensor) -> Optional[int]:
        """The id of the region holding ``tensor``'s storage if it was exported before."""
        _, key = self._storage_key(tensor)
        region = self._regions.get(key)
        if region is None or region.weak.expired():
            return None
        self._ref_used.add(region.rid)
        return region.rid

    def _export_region(self, tensor: torch.Tensor) -> int:
        storage, key = self._storage_key(tensor)
        stale = self._regions.pop(key, None)
        if stale is not None:  # same address, but that storage died: a new region
            self._forget_region(stale.rid)
        region = _Region(self._next_rid, StorageWeakRef(storage))
        self._next_rid += 1
        descs = self._ops.export(tensor, self._num_receivers)
        for r, desc in enumerate(descs):
            self._region_store.set(self._region_key(region.rid, r), encode(HelloMsg(
                stream=self._rank, rank=r, bucket_size=storage.nbytes(), num_slots=0,
                handles=(desc,))))
        self._regions[key] = region
        self._ref_used.add(region.rid)
        return region.rid

    def _publish_refs(self, state: Any) -> None:
        if not self._ref_entries:
            return
        k = len(self._ref_plan_new)
        entries = tuple(self._ref_entries)
        bucket = Bucket(REF_INDEX_BASE + k, sum(e.nbytes for e in entries), entries)
        cached, digest = self._tx_ref_plan[k] if k < len(self._tx_ref_plan) else (None, "")
        replay = cached == bucket
        digest = digest if replay else bucket_digest(bucket)
        # The tensors are ready behind the caller's stream. If it has nothing left to run,
        # they are ready now: receivers need not wait for an event of this process, whose
        # record runs only when the GPU next schedules this process (while a receiver's
        # copies run, that can be a time slice away).
        ready = self._ops.idle(self._tx_stream)
        if not ready:
            self._tx_done(len(self._bufs), state.version)
        msg = BucketMsg(version=wire_version(state.version), seq=state.seq, stream=self._rank,
                        index=bucket.index, slot=len(self._bufs), nbytes=bucket.nbytes,
                        layout=digest, entries=None if replay else entries, ready=ready)
        self._tx_control().push_many(self._receiver_boxes(), msg)
        self._ref_plan_new.append((bucket, digest))
        self._ref_entries, self._ref_bytes = [], 0

    async def _flush(self, state: Any, upto: Optional[int] = None) -> None:
        await super()._flush(state, upto)
        if upto is None:  # the end of the tensor stream
            await self._blocking(self._publish_refs, state)

    def _finish_stream(self, state: Any) -> None:
        super()._finish_stream(state)
        self._tx_ref_plan = self._ref_plan_new
        self._ref_prev = self._ref_seen
        if len(self._ref_used) == len(self._regions):
            return  # every exported storage was sent again: nothing to release
        for key, region in list(self._regions.items()):
            if region.rid not in self._ref_used or region.weak.expired():
                del self._regions[key]
                self._forget_region(region.rid)

    def _forget_region(self, rid: int) -> None:
        for r in range(self._num_receivers):
            try:
                self._region_store.delete_key(self._region_key(rid, r))
            except (RuntimeError, AttributeError, ConnectionError):
                logger.debug("could not delete region key %d", rid, exc_info=True)

    def _abort_send(self, state: Any, exc: BaseException) -> None:
        self._tx_ref_plan = []  # the next sync sends every zero-copy layout afresh
        self._ref_prev = []
        self._clear_refs()
        super()._abort_send(state, exc)

    def _report(self, state: Any, seconds: float) -> dict[str, Any]:
        out = super()._report(state, seconds)
        out.update(ref_tensors=self._ref_stats[0], ref_bytes=self._ref_stats[1],
                   ref_batches=len(self._ref_plan_new))
        return out

    def reset_plan(self) -> None:
        super().reset_plan()
        self._tx_ref_plan = []
        self._ref_prev = []
        self._rx_ref_plans = {}
        self._rx_batches = {}

    # -- zero-copy: receiver --------------------------------------------------------------------
    def _fetch_regions(self, stream: int, msg: BucketMsg) -> _RegionView:
        regions = self._rx_regions.setdefault(stream, {})
        for e in msg.entries or ():
            rid = e.offset >> REGION_SHIFT
            if rid not in regions:
                regions[rid] = self._open_region(stream, rid, msg.version)
        return _RegionView(regions, self._ops.device)

    def _open_region(self, stream: int, rid: int, version: Any) -> torch.Tensor:
        peer = f"trainer rank {stream}"
        key = f"{self._prefix(stream)}/region/{rid}/r{self._rank}"
        try:
            raw = self._rx_region_store[stream].get(key)
        except (RuntimeError, ValueError, ConnectionError) as exc:
            raise SyncTimeout(f"no descriptor for shared storage {rid}: {exc}", peer=peer,
                              phase="receive", version=version) from None
        msg = decode(raw)
        if not isinstance(msg, HelloMsg) or len(msg.handles) != 1 or msg.stream != stream:
            raise PlanMismatch(f"bad descriptor for shared storage {rid}", peer=peer,
                               phase="receive", version=version)
        return self._open(msg.handles[0], msg.bucket_size, peer)

    def _rx_src_key(self, buf: Any, entries: tuple[TensorMeta, ...]) -> Any:
        if isinstance(buf, _RegionView):
            return buf.key(entries)
        return super()._rx_src_key(buf, entries)

    def _ref_layout(self, stream: int, msg: BucketMsg) -> tuple[TensorMeta, ...]:
        peer = f"trainer rank {stream}"
        k = msg.index - REF_INDEX_BASE
        self._rx_batches[stream] = max(self._rx_batches.get(stream, 0), k + 1)
        plan = self._rx_ref_plans.setdefault(stream, [])
        if msg.entries is None:
            if k >= len(plan) or plan[k][1] != msg.layout:
                raise PlanMismatch(f"zero-copy batch {k} replays a layout this receiver does "
                                   "not hold; re-initialize", peer=peer, phase="receive",
                                   version=msg.version)
            bucket = plan[k][0]
        else:
            bucket = Bucket(msg.index, msg.nbytes, msg.entries)
            if bucket_digest(bucket) != msg.layout or k > len(plan):
                raise PlanMismatch(f"zero-copy batch {k} does not match its digest or order",
                                   peer=peer, phase="receive", version=msg.version)
            plan[k:k + 1] = [(bucket, msg.layout)]
        regions = self._rx_regions.get(stream, {})
        used = self._rx_used.setdefault(stream, set())
        for e in bucket.entries:
            rid, local = divmod(e.offset, 1 << REGION_SHIFT)
            region = regions.get(rid)
            if e.is_chunk or e.nbytes == 0 or region is None or local + e.nbytes > region.numel():
                raise PlanMismatch(f"zero-copy entry {e.name!r} lies outside shared storage "
                                   f"{rid}", peer=peer, phase="receive", version=msg.version)
            used.add(rid)
        return bucket.entries

    def _rx_finish_stream(self, state: Any, stream: int, msg: Any) -> None:
        used = self._rx_used.pop(stream, set())
        batches = self._rx_batches.pop(stream, 0)
        regions = self._rx_regions.get(stream, {})
        dropped = [r for r in regions if r not in used]
        for rid in dropped:
            del regions[rid]  # releases the mapping (and the trainer's reference)
        # programs read mappings that went, or batches this sync no longer sent
        self._rx_drop_programs(stream, min_index=REF_INDEX_BASE + (0 if dropped else batches))
        super()._rx_finish_stream(state, stream, msg)
