"""Pushes for ``cuda_ipc``: the trainer writes straight into the receivers' own tensors.

With ``push=True`` on both sides (``"event"`` ordering, no checksum), a receiver that calls
``receive_into`` offers the trainers its destination tensors that live on the shared GPU
(a ``LandMsg`` per trainer rank at the start of every receive; each tensor's *storage* is
exported once, a descriptor per trainer rank in that trainer's control store). A tensor
every receiver offered with its exact shape and dtype is then copied by the trainer, on
its own stream, straight into every receiver's memory: one copy per receiver, no bucket,
no header per batch, and no program the receiver launches. A tensor whose bytes outlive
its item is held for a batch (an eighth of a bucket) issued as one replayed program (a
CUDA graph from its second use on, as the fill programs); any other is copied at once.

Ordering: the receiver records its "done" event on its current stream before it offers,
and the trainer waits (bounded, on the host) for every receiver's event before its first
write, so nothing the receiver queued before ``receive_into`` still reads its tensors.
After the last write the trainer records its zero-copy "filled" event and names the
pushed tensors in one message (before its Done); the receiver waits for that event
(bounded, on the host) before it yields them.

Lifecycle: the trainer maps each exported storage once and keeps the mapping while the
receiver offers it; a storage no longer offered is unmapped at the trainer's next sync.
While mapped, the receiver's memory stays allocated even if the receiver frees the
tensor (CUDA IPC keeps it for the importer): an engine that frees its weights between
syncs (sleep) gives that memory back only after the next sync. Memory that cannot be
exported (an allocator of the engine's own, e.g. vLLM's sleep-mode pool) is not offered
and goes the usual way.

Measured on one H100 (BENCHMARKS.md, session 24): slower than zero-copy (14.1 against
12.2 ms for 16 GB), since the receiver yields the pushed tensors only after its host saw
the trainer's writes end; hence off by default.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from weightsync.core.errors import PlanMismatch, SyncTimeout
from weightsync.core.plan import DTYPES, TensorMeta, dtype_name, itemsize
from weightsync.core.remote import wire_version
from weightsync.core.wire import (DIRECT_BASE, PUSHED_SLOT, BucketMsg, HelloMsg, LandMsg,
                                  decode, encode)
from weightsync.transport.tensors import wire_dtype

__all__ = ["PushMixin"]

logger = logging.getLogger(__name__)

_DTYPES = frozenset(DTYPES.values())


class PushMixin:
    """Pushes for :class:`~weightsync.transport.backends.cuda_ipc.engine.CudaIpcEngine`
    (which provides ``options``, ``_ops``, ``_events``, the events, the control channels
    and ``_wait_event``)."""

    def _init_push(self) -> None:
        self._push = False                 # trainer: every receiver offers, each sync
        self._push_rx = False              # receiver: offer at every receive_into
        # receiver: exported storages, storage key -> (region id, weak ref), and the offer
        self._land_regions: dict[tuple, tuple[int, Any]] = {}
        self._land_next = 0
        self._land_key: Optional[tuple] = None
        self._land_offer: tuple = ()
        self._land_offer_digest = ""
        self._land_sent: dict[int, str] = {}
        # trainer: offers per receiver, the mappings, and this sync's destinations
        self._landings: dict[int, dict[str, tuple]] = {}
        self._land_digest: dict[int, str] = {}
        self._land_early: dict[tuple[int, int], LandMsg] = {}
        self._push_maps: dict[tuple[int, int], torch.Tensor] = {}
        self._push_key: Optional[tuple] = None
        self._push_dests: dict[str, tuple] = {}
        self._push_progs: dict[int, tuple] = {}
        self._push_count = 0               # tensors the last sync pushed (its report)
        self._clear_push()

    def _clear_push(self) -> None:
        self._pushed: list[TensorMeta] = []
        self._push_pairs: list[tuple] = []
        self._push_bytes = 0
        self._push_batch = 0

    # -- receiver -------------------------------------------------------------------------
    def _rx_begin(self, state: Any) -> None:
        """Offer the trainers this receive's destination tensors on the shared GPU."""
        super()._rx_begin(state)
        if not self._push_rx or state.into is None:
            return
        into = state.into
        key = tuple((name, t.data_ptr(), tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor)
                    else (name,) for name, t in into.items())
        if key != self._land_key or any(weak.expired() for _, weak in
                                        self._land_regions.values()):
            self._land_offer = self._make_offer(into)
            self._land_key = key
            self._land_offer_digest = hashlib.blake2b(
                repr(self._land_offer).encode(), digest_size=16).hexdigest()
        landings, digest = self._land_offer, self._land_offer_digest
        # nothing queued so far on this stream may still read the tensors when the trainer
        # writes: it waits for this record before its first write
        for s in range(self._world):
            self._ops.record(self._rx_drained[s][-1], self._ops.current_stream())
        for s in range(self._world):
            same = self._land_sent.get(s) == digest
            self._rx_control(s).push("t", LandMsg(seq=state.seq, rank=self._rank,
                                                  digest=digest,
                                                  landings=None if same else landings))
            self._land_sent[s] = digest

    def _make_offer(self, into: Any) -> tuple:
        """Landings of the tensors that can be written from another process: contiguous, on
        this GPU, their storage exported (once per storage)."""
        landings, alive = [], set()
        for name, t in into.items():
            if not isinstance(t, torch.Tensor) or t.device != self._ops.device \
                    or not t.is_contiguous() or t.numel() == 0 or t.dtype not in _DTYPES:
                continue
            storage, skey = self._storage_key(t)     # as zero-copy keys the trainer's
            found = self._land_regions.get(skey)
            if found is None or found[1].expired():
                try:
                    rid = self._export_landing(t)
                except (RuntimeError, ValueError) as exc:   # not exportable: not offered
                    logger.debug("cuda_ipc: %s cannot be pushed into (%s)", name, exc)
                    continue
                found = self._land_regions[skey] = (rid, StorageWeakRef(storage))
            alive.add(skey)
            landings.append((name, tuple(t.shape), dtype_name(t.dtype), found[0], 0,
                             storage.nbytes(), t.storage_offset() * t.element_size()))
        for skey in [k for k in self._land_regions if k not in alive]:
            rid = self._land_regions.pop(skey)[0]
            for s in range(self._world):
                try:
                    self._rx_region_store[s].delete_key(self._land_key_of(s, self._rank, rid))
                except (RuntimeError, AttributeError, ConnectionError):
                    logger.debug("could not delete landing key %d", rid, exc_info=True)
        return tuple(landings)

    def _export_landing(self, tensor: torch.Tensor) -> int:
        rid = self._land_next
        self._land_next += 1
        descs = self._ops.export(tensor, self._world)
        for s, desc in enumerate(descs):
            self._rx_region_store[s].set(self._land_key_of(s, self._rank, rid), encode(HelloMsg(
                stream=s, rank=self._rank, bucket_size=tensor.untyped_storage().nbytes(),
                num_slots=0, handles=(desc,))))
        return rid

    def _land_key_of(self, stream: int, rank: int, rid: int) -> str:
        return f"{self._prefix(stream)}/land/r{rank}/{rid}"

    def _rx_pushed_wait(self, stream: int, msg: BucketMsg) -> None:
        """Pump thread, on the trainer's message naming what it wrote: its writes are done
        before the consumer sees the tensors."""
        self._wait_event(self._rx_filled[stream][-1], peer=f"trainer rank {stream}",
                         phase="receive", version=msg.version)

    # -- trainer ---------------------------------------------------------------------------
    def _tx_stash(self, msg: Any) -> None:
        if self._push and isinstance(msg, LandMsg):     # the next sync's offer
            self._land_early[(msg.seq, msg.rank)] = msg

    async def _tx_begin(self, state: Any) -> None:
        await super()._tx_begin(state)
        self._clear_push()
        if self._push:
            await self._blocking(self._await_offers, state)

    def _await_offers(self, state: Any) -> None:
        """Every receiver's offer for this sync (sent when its receive began), mapped; then
        the trainer waits until nothing a receiver queued before its offer still runs."""
        key = self._collect_offers(state)
        if key != self._push_key:
            self._push_key = None
            self._push_dests = self._map_offers(state)
            self._push_progs = {}
            self._push_key = key
        if self._push_dests:
            self._wait_receivers_idle(state)

    def _wait_receivers_idle(self, state: Any) -> None:
        """Before the first write: what each receiver queued before its offer is done."""
        for r in range(self._num_receivers):
            self._wait_event(self._drained[r][-1], peer=f"rollout rank {r}", phase="send",
                             version=state.version)

    def _map_offers(self, state: Any) -> dict[str, tuple]:
        """The tensors every receiver offered alike: name -> (shape, dtype, views)."""
        used: set[tuple[int, int]] = set()
        first = self._landings.get(0, {})
        dests: dict[str, tuple] = {}
        for name, (_, shape, dtype, *_) in first.items():
            views = []
            for r in range(self._num_receivers):
                entry = self._landings.get(r, {}).get(name)
                if entry is None or entry[1] != shape or entry[2] != dtype:
                    break
                rid, size, offset = entry[3], entry[5], entry[6]
                mapped = self._push_map(r, rid, size, state)
                used.add((r, rid))
                nbytes = itemsize(dtype) * int(torch.Size(shape).numel())
                views.append(mapped[offset: offset + nbytes])
            else:
                dests[name] = (shape, dtype, views)
        for key in [k for k in self._push_maps if k not in used]:
            del self._push_maps[key]       # unmapped once nothing here refers to it
        self._ops.collect()
        return dests

    def _push_map(self, rank: int, rid: int, size: int, state: Any) -> torch.Tensor:
        mapped = self._push_maps.get((rank, rid))
        if mapped is not None:
            return mapped
        peer = f"rollout rank {rank}"
        try:
            raw = self._region_store.get(self._land_key_of(self._rank, rank, rid))
        except (RuntimeError, ValueError, ConnectionError) as exc:
            raise SyncTimeout(f"no descriptor for offered storage {rid}: {exc}", peer=peer,
                              phase="send", version=state.version) from None
        msg = decode(raw)
        if not isinstance(msg, HelloMsg) or len(msg.handles) != 1 or msg.rank != rank \
                or msg.bucket_size != size:
            raise PlanMismatch(f"bad descriptor for offered storage {rid}", peer=peer,
                               phase="send", version=state.version)
        mapped = self._push_maps[(rank, rid)] = self._open(msg.handles[0], size, peer)
        return mapped

    async def _pack(self, state: Any, name: str, tensor: torch.Tensor) -> None:
        # before zero-copy's references: a pushed tensor needs neither bucket nor reference
        if self._push_dests and self._tx_push(state, name, tensor,
                                              wire_dtype(tensor, self.config.dtype)):
            return
        await super()._pack(state, name, tensor)

    def _tx_push(self, state: Any, name: str, tensor: torch.Tensor,
                 dtype: torch.dtype) -> bool:
        found = self._push_dests.get(name) if self._push else None
        if found is None or tensor.device != self._ops.device:
            return False
        shape, wire, views = found
        if tuple(tensor.shape) != shape or dtype_name(dtype) != wire:
            return False
        nbytes = views[0].numel()
        pairs = [(view.view(dtype).view(shape), tensor) for view in views]
        if self._tracking and self._lasting.lasting(name, tensor, version=state.version):
            self._push_pairs += pairs          # its bytes stay: held for its batch's program
            self._push_bytes += nbytes * len(views)
            if self._push_bytes >= self._batch_bytes:
                self._issue_pushes()
        else:
            self._ops.copy_many(pairs, self._tx_stream)   # now, before the export moves on
        self._pushed.append(TensorMeta(name, shape, wire, 0, nbytes, 0, nbytes))
        state.tensors += 1
        state.nbytes += nbytes
        return True

    def _issue_pushes(self) -> None:
        """The held writes, through the program of this batch of the sync (the same one
        while they cover the same memory: a CUDA graph from its second use on)."""
        pairs, self._push_pairs, self._push_bytes = self._push_pairs, [], 0
        if not pairs:
            return
        batch, self._push_batch = self._push_batch, self._push_batch + 1
        memory = tuple((d.data_ptr(), s.data_ptr(), d.numel() * d.element_size(), d.dtype,
                        s.dtype) for d, s in pairs)
        prog = self._push_progs.get(batch)
        if prog is None or prog[0] != memory:
            prog = self._push_progs[batch] = (memory,
                                              self._ops.copy_runner(self.options.graph_branches))
        self._ops.run_copies(prog[1], lambda: pairs, self._tx_stream)

    def _finish_stream(self, state: Any) -> None:
        """Name what was written into the receivers' memory (behind the "filled" event
        recorded after the writes), then end."""
        if self._pushed:
            self._issue_pushes()
            self._ops.record(self._filled[-1], self._tx_stream)
            msg = BucketMsg(version=wire_version(state.version), seq=state.seq,
                            stream=self._rank, index=DIRECT_BASE, slot=PUSHED_SLOT,
                            nbytes=sum(m.nbytes for m in self._pushed), layout="pushed",
                            entries=tuple(self._pushed))
            self._push_count = len(self._pushed)
            self._clear_push()
            self._tx_control().push_many(self._receiver_boxes(), msg)
        super()._finish_stream(state)

    def _abort_send(self, state: Any, exc: BaseException) -> None:
        self._clear_push()
        super()._abort_send(state, exc)

    def _report(self, state: Any, seconds: float) -> dict[str, Any]:
        out = super()._report(state, seconds)
        out["pushed"], self._push_count = self._push_count, 0
        return out

    def _release_push(self) -> None:
        self._push_maps, self._push_dests, self._push_progs = {}, {}, {}
        self._landings, self._land_digest, self._land_early = {}, {}, {}
        self._land_regions, self._land_key, self._land_offer, self._land_sent = {}, None, (), {}
        self._push_key, self._push, self._push_rx = None, False, False
        self._clear_push()
