"""A ``nixl`` receiver's compiled pull: where each tensor it keeps lands, and the prepared
reads that fill it.

:class:`PullPlan` is built once per (trainer layouts, destinations) and replayed by every
sync. Each tensor the receiver keeps whole lands either straight in the caller's own
tensor (``receive_into`` with a contiguous tensor of the same shape, dtype and device:
registered with NIXL, no copy left) or in one registered landing buffer the receiver owns
(views of it are yielded, valid until the next sync). Of a tensor the receiver keeps only
some boxes of (a :class:`~weightsync.core.xferplan.Keep`: a tensor-parallel worker), only
those boxes are read. A tensor kept as one box whose ``into[name]`` is a contiguous tensor
of that box's shape, dtype and device (the worker's own shard of a parameter) gets the
box's bytes straight in it, registered like a whole tensor: no landing, no copy. Other
boxes go into the landing buffer and are then placed into a tensor of the full shape
(``into[name]`` if given, else a fresh one marked with
:func:`~weightsync.transport.tensors.mark_partial`) whose other elements are left as they
were (undefined in a fresh one), or copied into ``into[name]`` when that has the shape of
its one box. The reads come from
:func:`~weightsync.core.xferplan.compile_plan`, pieces of at most ``max_read`` bytes so
that trainer ranks holding the same bytes share the serving; one
:class:`~weightsync.transport.backends.nixl.agent.Reads` per staging block of each trainer
rank (a pipelined sync starts each once the rank says that block is written) and one for
all it serves from its own storage. Used by :mod:`weightsync.transport.backends.nixl.engine`.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Optional

import torch

from weightsync.core.plan import dtype_from_name
from weightsync.core.xferplan import DestLayout, Keep, SourceLayout, TransferPlan, Want, compile_plan
from weightsync.transport.backends.nixl.agent import NixlAgent, Reads, mem_type
from weightsync.transport.backends.nixl.layout import held_of
from weightsync.transport.tensors import mark_partial

__all__ = ["PullPlan", "plan_key", "union_of", "block_regions", "OWN"]

logger = logging.getLogger(__name__)
_LANDING = "landing"
#: the group of reads of everything a trainer rank serves from its own storage
OWN = "own"


def _direct(into: Optional[Mapping[str, torch.Tensor]], name: str, shape: tuple,
            dtype: str, device: torch.device) -> Optional[torch.Tensor]:
    """The caller's tensor for ``name`` if the bytes can land in it as they are."""
    t = None if into is None else into.get(name)
    if t is None or not t.numel():
        return None
    if (tuple(t.shape) == shape and t.dtype == dtype_from_name(dtype) and t.is_contiguous()
            and t.device == device):
        return t
    return None


def _whole(shape: tuple) -> tuple:
    return (tuple((0, d) for d in shape),)


def _direct_box(into: Optional[Mapping[str, torch.Tensor]], name: str, boxes: tuple,
                dtype: str, device: torch.device) -> Optional[torch.Tensor]:
    """The caller's tensor for a tensor kept as one box, if that box's bytes can land in
    it as they are (contiguous, of the box's shape, dtype and device)."""
    if len(boxes) != 1:
        return None
    return _direct(into, name, tuple(b - a for a, b in boxes[0]), dtype, device)


def _own(into: Optional[Mapping[str, torch.Tensor]], name: str, shape: tuple, dtype: str,
         device: torch.device, keep: Optional[Keep]) -> Optional[torch.Tensor]:
    """Where ``name`` lands straight in the caller's memory (whole or its one kept box;
    a box listed as the whole tensor has the tensor's shape, so it is the same check)."""
    boxes = None if keep is None else keep.boxes.get(name)
    if boxes is None:
        return _direct(into, name, shape, dtype, device)
    return _direct_box(into, name, boxes, dtype, device)


def union_of(sources: list) -> list[tuple[str, tuple, str]]:
    """Every tensor some trainer rank serves, in the order the ranks list them."""
    seen, out = set(), []
    for src in sources:
        for name, shape, dtype, *_ in src.held:
            if name not in seen:
                seen.add(name)
                out.append((name, tuple(shape), dtype))
    return out


def block_regions(src: Any) -> set[str]:
    """The staging blocks of a trainer rank's layout (``b<n>``; ``p<addr>`` regions are
    tensors it serves from their own storage)."""
    return {name for name, *_ in src.regions if name.startswith("b")}


def _align(n: int) -> int:
    return -(-n // 256) * 256


def plan_key(sources: list, into: Optional[Mapping[str, torch.Tensor]],
             device: torch.device, keep: Optional[Keep] = None) -> tuple:
    """What a compiled pull depends on: the trainers' layouts and the caller's tensors that
    bytes land in straight (for ``keep``: whole, or of a kept box's shape)."""
    if into is None:
        return tuple(s.digest for s in sources), ()
    direct = tuple((n, t.data_ptr()) for n, s, d in union_of(sources)
                   if (t := _own(into, n, s, d, device, keep)) is not None)
    return tuple(s.digest for s in sources), direct


class PullPlan:
    """One receiver's compiled pull (see the module doc)."""

    def __init__(self, agent: NixlAgent, worker: str, sources: list,
                 into: Optional[Mapping[str, torch.Tensor]], device: torch.device,
                 max_read: int, keep: Optional[Keep] = None,
                 peers: Optional[Mapping[int, str]] = None, spread: int = 0) -> None:
        self._agent, self._regs = agent, []
        self._peers = dict(peers or {})
        # (name, shape, dtype, dest, offset, nbytes, parts): parts None for a whole tensor,
        # else ((box, landing offset, nbytes), ...)
        self.views: list[tuple] = []
        buffers: dict[str, torch.Tensor] = {}
        wants, offset, self.partial = [], 0, 0
        for name, shape, dtype in union_of(sources):
            size = dtype_from_name(dtype).itemsize
            nbytes = math.prod(shape) * size
            boxes = _whole(shape) if keep is None else keep.of(name, shape)
            if boxes != _whole(shape) and (own := _direct_box(into, name, boxes, dtype,
                                                                 device)) is not None:
                dest = f"p{own.data_ptr():x}"        # the worker's own shard
                buffers[dest] = own
                wants.append(Want(name=name, dtype=dtype, box=boxes[0], dest=dest, offset=0))
                self.views.append((name, tuple(own.shape), dtype, dest, 0,
                                   own.numel() * size, None))
                self.partial += 1
                continue
            if boxes != _whole(shape):
                parts = []
                for box in boxes:
                    n = math.prod(b - a for a, b in box) * size
                    if n:
                        wants.append(Want(name=name, dtype=dtype, box=box, dest=_LANDING,
                                          offset=offset))
                        parts.append((box, offset, n))
                        offset += _align(n)
                self.views.append((name, shape, dtype, _LANDING, 0, nbytes, tuple(parts)))
                self.partial += 1
                continue
            own = _direct(into, name, shape, dtype, device)
            dest, at = (f"p{own.data_ptr():x}", 0) if own is not None else (_LANDING, offset)
            if own is not None:
                buffers[dest] = own
            else:
                offset += _align(nbytes)
            wants.append(Want(name=name, dtype=dtype, box=tuple((0, d) for d in shape),
                              dest=dest, offset=at))
            self.views.append((name, shape, dtype, dest, at, nbytes, None))
        notes = () if keep is None else keep.notes
        self.plan: TransferPlan = compile_plan(
            [SourceLayout(rank=s, held=held_of(src)) for s, src in enumerate(sources)],
            [DestLayout(worker=worker, wants=tuple(wants), notes=notes)], max_read_bytes=max_read,
            spread=spread)
        buffers[_LANDING] = torch.empty(max(offset, 1), dtype=torch.uint8, device=device)
        self.landing = buffers[_LANDING]
        self._buffers = buffers
        for t in buffers.values():
            self._regs.append(agent.register(t))
        # per trainer rank: its staging blocks' reads (each may start once that block is
        # written: a pipelined sync), and one read of all it serves from its own storage
        self.reads_by = [self._reads_from(s, src, device) for s, src in enumerate(sources)]
        self.bytes_from = {s: sum(r.nbytes for r in by.values())
                           for s, by in enumerate(self.reads_by)}
        self.direct = len(buffers) - 1

    @property
    def reads(self) -> list[Reads]:
        return [r for by in self.reads_by for r in by.values()]

    @staticmethod
    def group_of(region: str, blocks: set) -> str:
        """Reads of a staging block go in their own group; all others (tensors served from
        their own storage) in one, ``OWN``."""
        return region if region in blocks else OWN

    def _reads_from(self, s: int, src: Any, device: torch.device) -> dict[str, Reads]:
        regions = {name: (addr, dev) for name, addr, _, dev in src.regions}
        blocks = block_regions(src)
        peer = self._peers.get(s, f"trainer rank {s}")
        self._agent.remove_remote(src.agent)          # its metadata lists its registrations
        self._agent.add_remote(src.agent, src.metadata, peer=peer)
        groups: dict[str, list] = {}
        for r in self.plan.reads_from(s):
            groups.setdefault(self.group_of(r.src_region, blocks), []).append(r)
        out = {}
        for group, mine in groups.items():
            local = [(self._buffers[r.dst].data_ptr() + r.dst_offset, r.nbytes) for r in mine]
            remote = [(regions[r.src_region][0] + r.src_offset, r.nbytes) for r in mine]
            out[group] = self._agent.reads(src.agent, local, remote, mem=mem_type(device),
                                           remote_mem=src.mem, device=device.index or 0,
                                           remote_device=regions[mine[0].src_region][1],
                                           peer=peer)
        return out

    def tensors(self, into: Optional[Mapping[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of what landed: the caller's own tensor where the bytes went
        there; else a view of the landing buffer, copied into ``into[name]`` if given; a
        tensor kept in part: its boxes placed into ``into[name]`` or a fresh tensor (its
        one box copied into ``into[name]`` when that has the box's shape)."""
        out = []
        for name, shape, dtype, dest, at, nbytes, parts in self.views:
            if dest != _LANDING:
                out.append((name, self._buffers[dest]))
                continue
            target = None if into is None else into.get(name)
            if (target is not None and parts is not None and len(parts) == 1
                    and tuple(target.shape) == tuple(b - a for a, b in parts[0][0])
                    and tuple(target.shape) != tuple(shape)):
                _, at, n = parts[0]                 # the worker's shard, not contiguous
                target.copy_(self.landing[at:at + n].view(dtype_from_name(dtype))
                             .view(target.shape))
                out.append((name, target))
                continue
            if target is not None and tuple(target.shape) != tuple(shape):
                raise ValueError(f"receive_into: {name} has shape {tuple(shape)}, "
                                 f"params[{name!r}] has {tuple(target.shape)}")
            if parts is not None:
                out.append((name, self._place(name, shape, dtype, parts, target)))
                continue
            view = self.landing[at:at + nbytes].view(dtype_from_name(dtype)).view(shape)
            if target is not None:
                target.copy_(view)
                view = target
            out.append((name, view))
        return out

    def _place(self, name: str, shape: tuple, dtype: str, parts: tuple,
               target: Optional[torch.Tensor]) -> torch.Tensor:
        dt = dtype_from_name(dtype)
        fresh = target is None
        if fresh:
            target = torch.empty(shape, dtype=dt, device=self.landing.device)
        for box, at, n in parts:
            src = self.landing[at:at + n].view(dt).view(tuple(b - a for a, b in box))
            target[tuple(slice(a, b) for a, b in box)].copy_(src)
        if fresh:
            mark_partial(target, tuple(b for b, _, _ in parts))
        return target

    def served_layout(self) -> Optional[tuple[tuple, tuple]]:
        """``(regions, held)`` in a :class:`~weightsync.core.wire.SourceMsg`'s form for the
        memory this receiver landed every tensor in (the landing buffer and the caller's
        own tensors), so a joiner can read the version from it; None when some tensor is
        kept only in part (a tensor-parallel worker holds no whole copy to serve)."""
        if self.partial:
            return None
        regions = []
        for region, t in self._buffers.items():
            dev = (t.device.index or 0) if t.device.type == "cuda" else 0
            regions.append((region, t.data_ptr(), t.numel() * t.element_size(), dev))
        held = tuple((name, list(shape), dtype, 0, math.prod(shape), dest, at)
                     for name, shape, dtype, dest, at, _, _ in self.views)
        return tuple(sorted(regions)), held

    def release(self) -> None:
        for r in self.reads:
            r.release()
        for reg in self._regs:
            self._agent.deregister(reg)
        self.reads_by, self._regs, self._buffers = [], [], {}
