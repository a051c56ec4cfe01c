"""What a ``nixl`` trainer rank serves, and where it lives.

:func:`held_part` turns one yielded tensor into the part this rank holds, with no gather:
a plain tensor is the whole of it; a DTensor whose placements are all ``Shard`` or
``Replicate`` (FSDP2 ``Shard(0)`` rows, a tensor-parallel shard on any dim, the block of a
2-D mesh, an expert-parallel slice of fused experts) is its local shard, a box of the full
tensor: elements ``[start, stop)`` of the flattened tensor when the box is contiguous in
it, else the box itself (a row-parallel weight's columns: one run per row). Any other
placement (``Partial``) is gathered (``full_tensor``) and logged once. FSDP2 over TP's
strided shards of a dim TP also splits are blocks too (:func:`local_box`).

:class:`Arena` keeps those parts in memory registered with the rank's NIXL agent: blocks
of at least ``bucket_size`` bytes, allocated and registered once, reused by every sync
whose layout (names, shapes, dtypes, held ranges, in order) is the one of the sync
before. A changed layout is re-placed into fresh blocks, so the blocks always hold exactly
the current layout. A contiguous tensor already in the wire dtype may instead be served
from its own storage (registered once per storage, kept alive while served; no copy):
always with ``mode="params"``; with ``mode="auto"`` (the default) when
:class:`~weightsync.transport.tensors.LastingStorage` says its bytes outlive the item:
from the first sync when the export marked it as a view of a parameter
(:func:`~weightsync.transport.tensors.mark_stable`), else once it has ``OWN_MIN_BYTES`` or
more and is yielded under one name from the same storage two syncs in a row, that storage
alive in between (parameters and FSDP2 local shards are; temporaries such as casts or
merged LoRA weights are not, even when allocated where the last sync's was freed, nor is
a buffer refilled for several names: those stay staged). A tensor named in
:meth:`Arena.set_cuts` (every receiver keeps it as a partition with a strided box: a
row-parallel weight's column blocks) is staged box by box instead, each piece contiguous
(:func:`cut_pieces`), so each receiver's box is one read. Used by
:mod:`weightsync.transport.backends.nixl.engine` on trainer ranks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from typing import Any, Optional

import torch

from weightsync.core.plan import dtype_name
from weightsync.core.xferplan import HeldBox, HeldRange, box_is_run, cut_boxes
from weightsync.transport.fastcopy import memmove_at
from weightsync.transport.tensors import LastingStorage, is_stable, plain_cpu
from weightsync.transport.backends.nixl.agent import NixlAgent, mem_type

__all__ = ["Arena", "cut_pieces", "cut_plan", "held_part", "held_of", "layout_digest", "local_box"]

logger = logging.getLogger(__name__)
_ALIGN = 256
#: ``auto`` serves unmarked tensors of at least this size from their own storage
OWN_MIN_BYTES = 64 << 10
_warned: set[str] = set()


def local_box(t: torch.Tensor) -> Optional[tuple[tuple[int, int], ...]]:
    """The box of the full tensor that a DTensor's local shard is, when its placements are
    ``Shard``/``Replicate`` (each mesh dim chunks the range the ones before left, as
    ``torch.chunk``) or FSDP2-over-TP's strided shard (``_StridedShard(d, split_factor)``
    first on dim ``d``, ``split_factor`` the product of the later mesh dims sharding ``d``:
    it chunks what they left); None for any other placement or when the local shape
    disagrees."""
    shape = tuple(int(d) for d in t.shape)
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    ops: dict[int, list] = {}           # tensor dim -> [(mesh dim, strided?)] in mesh order
    for i, p in enumerate(t.placements):
        if p.is_replicate():
            continue
        kind = type(p).__name__
        if kind == "_StridedShard" and not ops.get(p.dim):
            ops.setdefault(p.dim, []).append((i, int(p.split_factor)))
        elif kind == "Shard" and p.is_shard():
            ops.setdefault(p.dim, []).append((i, 0))
        else:                               # Partial, a strided shard not first on its dim
            return None
    box = [[0, n] for n in shape]
    for dim, seq in ops.items():
        if seq[0][1]:                       # strided: the later mesh dims split dim first
            if seq[0][1] != math.prod(mesh.size(i) for i, _ in seq[1:]):
                return None
            seq = seq[1:] + seq[:1]
        for i, _ in seq:
            a, b = box[dim]
            chunk = -(-(b - a) // mesh.size(i)) if b > a else 0
            box[dim] = [min(a + coord[i] * chunk, b), min(a + (coord[i] + 1) * chunk, b)]
    out = tuple((a, b) for a, b in box)
    local = tuple(int(d) for d in t.to_local().shape)
    return out if local == tuple(b - a for a, b in out) else None


def _flat_range(shape: tuple[int, ...], box: tuple) -> Optional[tuple[int, int]]:
    """Elements ``[start, stop)`` of the flattened tensor the box is, if it is contiguous
    there (:func:`~weightsync.core.xferplan.box_is_run`)."""
    if not box_is_run(shape, box):
        return None
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    start = sum(a * st for (a, _), st in zip(box, strides))
    return start, start + math.prod(b - a for a, b in box)


def _held_box(start: int, stop: int, shape: tuple, box: Optional[tuple]) -> Optional[tuple]:
    """What a rank holds of a tensor as a box of it (a range of whole dim-0 rows is one),
    or None when the range is not one."""
    if box is not None:
        return tuple(box)
    if not shape:
        return None
    row = math.prod(shape[1:])
    if row == 0 or start % row or stop % row:
        return None
    return ((start // row, stop // row),) + tuple((0, d) for d in shape[1:])


def cut_pieces(local: torch.Tensor, start: int, stop: int, shape: tuple,
               box: Optional[tuple], cut: tuple,
               plan: Optional[tuple] = None) -> Optional[list[tuple[tuple, torch.Tensor]]]:
    """``(box, view of local)`` per piece :func:`~weightsync.core.xferplan.cut_boxes`
    stages of what this rank holds (``cut``: the boxes the receivers keep of the tensor),
    or None when the tensor is served as it is. ``plan``: :func:`cut_plan`'s result for
    these arguments, computed before."""
    held, pieces = cut_plan(start, stop, shape, box, cut) if plan is None else plan
    if pieces is None:
        return None
    extents = tuple(b - a for a, b in held)
    view = local if tuple(local.shape) == extents else local.reshape(extents)
    return [(piece, view[tuple(slice(a - h, b - h) for (a, b), (h, _) in zip(piece, held))])
            for piece in pieces]


def cut_plan(start: int, stop: int, shape: tuple, box: Optional[tuple],
             cut: tuple) -> tuple[Optional[tuple], Optional[tuple]]:
    """``(held box, pieces)`` for :func:`cut_pieces` (pieces None: not cut)."""
    held = _held_box(start, stop, shape, box)
    return held, None if held is None else cut_boxes(shape, held, cut)


def held_part(name: str, t: torch.Tensor) -> tuple[torch.Tensor, int, int, tuple[int, ...],
                                                   Optional[tuple]]:
    """``(local tensor, start, stop, full shape, box)`` of what this rank holds of ``t``:
    elements ``[start, stop)`` of the flattened tensor (``box`` None), or, when that part
    is not contiguous there, ``box`` (``start``/``stop``: 0 and its element count)."""
    shape = tuple(int(d) for d in t.shape)
    numel = math.prod(shape)
    # importing torch.distributed.tensor costs seconds: only for what may be a DTensor
    if not (hasattr(t, "placements") and hasattr(t, "to_local")):
        return t, 0, numel, shape, None
    placements = tuple(t.placements)
    if all(p.is_replicate() for p in placements):
        return t.to_local(), 0, numel, shape, None
    box = local_box(t) if shape else None
    if box is not None:
        local = t.to_local().contiguous()
        flat = _flat_range(shape, box)
        if flat is not None:
            return local, flat[0], flat[1], shape, None
        return local, 0, local.numel(), shape, box
    if name not in _warned:
        _warned.add(name)
        logger.warning("weightsync nixl: %s has placements %s: gathered in full to serve it",
                       name, placements)
    return t.full_tensor(), 0, numel, shape, None


def layout_digest(held: Any, regions: Any) -> str:
    """The digest of a served layout (its ``held`` entries and ``regions``, in a
    :class:`~weightsync.core.wire.SourceMsg`'s form): equal layouts, equal digests."""
    body = [list(e) for e in held] + [list(r) for r in regions]
    return hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()


def held_of(msg: Any) -> tuple[HeldRange | HeldBox, ...]:
    """The :class:`HeldRange` / :class:`HeldBox` entries of a
    :class:`~weightsync.core.wire.SourceMsg` (a box entry has the box as 8th field)."""
    out = []
    for n, s, d, a, b, r, o, *box in msg.held:
        if box and box[0] is not None:
            out.append(HeldBox(name=n, shape=tuple(s), dtype=d, box=tuple(map(tuple, box[0])),
                               region=r, offset=o))
        else:
            out.append(HeldRange(name=n, shape=tuple(s), dtype=d, start=a, stop=b, region=r,
                                 offset=o))
    return tuple(out)


class Arena:
    """The registered memory a trainer rank serves from (see the module doc)."""

    def __init__(self, agent: NixlAgent, block_size: int, *, mode: str = "auto") -> None:
        if mode not in ("auto", "staging", "params"):
            raise ValueError(f"mode must be auto, staging or params, got {mode!r}")
        self._agent = agent
        self._block_size = max(int(block_size), _ALIGN)
        self._mode = mode
        # which tensors ``auto`` may serve as they are (small ones are staged: a copy
        # costs less than a registration and a descriptor each)
        self._lasting = LastingStorage(min_bytes=OWN_MIN_BYTES)
        self._blocks: dict[str, tuple[torch.Tensor, Any]] = {}   # name -> (tensor, reg)
        self._own: dict[tuple[int, int], tuple[str, torch.Tensor, Any]] = {}
        self._prev: list[tuple] = []
        self._entries: list[tuple] = []
        self._cursor: Optional[tuple[str, int]] = None
        self._counter = 0
        self._device: Optional[torch.device] = None
        self.changed = False
        self.digest = ""
        self._pipelined = False
        self._last_of: dict[str, int] = {}
        self._deferred: list[tuple[torch.Tensor, Any]] = []
        self._cuts: dict[str, tuple] = {}
        # (name, shape, start, stop, box) -> cut_plan's result: checked once, not per sync
        self._cut_plans: dict[tuple, tuple] = {}

    def set_cuts(self, cuts: dict[str, tuple]) -> bool:
        """Stage each tensor named in ``cuts`` box by box (``cuts[name]``: the boxes every
        receiver keeps of it, see :func:`cut_pieces`), each box contiguous, so a receiver
        reads its box in one piece; such a tensor is always staged, never served from its
        own storage. True when this changes what the arena did."""
        cuts = {n: tuple(sorted(set(b))) for n, b in cuts.items()}
        if cuts == self._cuts:
            return False
        self._cuts, self._cut_plans = cuts, {}
        return True

    @property
    def mem(self) -> str:
        return mem_type(self._device or torch.device("cpu"))

    @property
    def nbytes(self) -> int:
        """Bytes of staging memory this arena holds (what serving costs in memory)."""
        return sum(b.numel() for b, _ in self._blocks.values())

    # -- one sync -------------------------------------------------------------------------
    def begin(self, pipelined: bool = False) -> None:
        """Start a sync. ``pipelined``: the previous layout is expected again and readers
        start on each block once it is written: :meth:`put` then returns the blocks it
        completed, and blocks are not freed until :meth:`release_deferred`."""
        self._entries, self.changed = [], False
        self._lasting.begin()
        self._pipelined = pipelined
        self._last_of = {}
        if pipelined:
            for i, e in enumerate(self._prev):
                self._last_of[e[5]] = i

    def put(self, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> list[str]:
        marked = is_stable(tensor)              # the mark is on what the export yielded
        local, start, stop, shape, box = held_part(name, tensor)
        if self._device is None:
            self._device = local.device
        elif local.device != self._device:
            raise ValueError(f"nixl: {name} is on {local.device}, earlier tensors on "
                             f"{self._device}; one trainer rank serves from one device")
        wire = dtype_name(dtype)
        cut = self._cuts.get(name)
        pieces = None
        if cut is not None:
            key = (name, shape, start, stop, box)
            plan = self._cut_plans.get(key)
            if plan is None:
                plan = self._cut_plans[key] = cut_plan(start, stop, shape, box, cut)
            pieces = cut_pieces(local, start, stop, shape, box, cut, plan)
        if pieces is not None:                  # box by box, each box contiguous
            done: list[str] = []
            for piece, view in pieces:
                n = math.prod(b - a for a, b in piece)
                done += self._stage((name, shape, wire, 0, n), (piece,), view, dtype)
            return done
        i = len(self._entries)
        key = (name, shape, wire, start, stop)
        tail = () if box is None else (tuple(box),)        # a box entry's 8th field
        if self._serve_own(name, local, dtype, marked):
            region = self._own_region(local)
            self._entries.append(key + (region, 0) + tail)
            self.changed = self.changed or i >= len(self._prev) or \
                self._prev[i] != key + (region, 0) + tail
            return []
        return self._stage(key, tail, local, dtype)

    def _stage(self, key: tuple, tail: tuple, local: torch.Tensor,
               dtype: torch.dtype) -> list[str]:
        """Copy ``local`` (the entry ``key`` + ``tail`` describes) into the staging blocks,
        at its place of the last sync's layout while that still holds."""
        i = len(self._entries)
        nbytes = local.numel() * dtype.itemsize
        if not self.changed and i < len(self._prev) and tuple(self._prev[i][:5]) == key \
                and tuple(self._prev[i][7:]) == tail and self._prev[i][5] in self._blocks:
            region, offset = self._prev[i][5], self._prev[i][6]
        else:
            if not self.changed:
                self._relocate()       # re-place what this sync already put, then go on
            region, offset = self._alloc(nbytes)
        self._entries.append(key + (region, offset) + tail)
        if nbytes:
            block = self._blocks[region][0]
            if local.dtype == dtype and block.device.type == "cpu" and plain_cpu(local):
                memmove_at(block, offset, local, nbytes)   # no views, no torch thread pool
            else:
                block[offset:offset + nbytes].view(dtype).view(local.shape).copy_(local)
        return self._completed(i)

    def _completed(self, i: int) -> list[str]:
        """Blocks whose last entry of the expected layout is entry ``i`` (pipelined and
        still on that layout), else none."""
        if not self._pipelined or self.changed:
            return []
        region = self._entries[i][5]
        if self._last_of.get(region) != i or region not in self._blocks:
            return []
        block = self._blocks[region][0]
        if block.device.type == "cuda":       # the copies into it are queued: let them land
            torch.cuda.current_stream(block.device).synchronize()
        return [region]

    def release_deferred(self) -> None:
        """Free the blocks a pipelined sync left (readers of it are all done)."""
        for _, reg in self._deferred:
            self._agent.deregister(reg)
        self._deferred = []

    def _serve_own(self, name: str, local: torch.Tensor, dtype: torch.dtype,
                   marked: bool) -> bool:
        if self._mode == "staging" or not local.is_contiguous() or not local.numel():
            return False
        if self._mode == "params":
            return dtype == local.dtype
        # auto: a marked parameter, or the same storage alive since the last sync that no
        # other name shares (a buffer the export refills per name is staged); raises if
        # the export rewrites the bytes of a tensor this sync already serves as they are
        lasting = self._lasting.lasting(name, local, marked=marked)
        return lasting and dtype == local.dtype

    def finish(self) -> None:
        self._lasting.finish()
        if not self.changed and len(self._entries) != len(self._prev):
            self._relocate()
        if self.changed:
            self._drop_unused()
        self._prev = list(self._entries)
        self.digest = layout_digest(self._entries, self.regions())

    def held(self) -> tuple[tuple, ...]:
        return tuple((n, list(s), d, a, b, r, o, *[[list(p) for p in x] for x in box])
                     for n, s, d, a, b, r, o, *box in self._entries)

    @property
    def serves_live(self) -> bool:
        """Whether some tensor is served from the caller's own storage (not a staged copy)."""
        own = {r for r, _, _ in self._own.values()}
        return any(e[5] in own for e in self._entries)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the parts of tensors this rank serves (its share of the model)."""
        return sum((b - a) * _dtype(d).itemsize for _, _, d, a, b, *_ in self._entries)

    def regions(self) -> tuple[tuple[str, int, int, int], ...]:
        dev = (self._device.index or 0) if self._device is not None and \
            self._device.type == "cuda" else 0
        out = [(name, t.data_ptr(), t.numel(), dev) for name, (t, _) in self._blocks.items()]
        out += [(name, t.data_ptr(), t.numel() * t.element_size(), dev)
                for name, t, _ in self._own.values()]
        return tuple(sorted(out))

    # -- placement ------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> tuple[str, int]:
        if self._cursor is not None:
            region, off = self._cursor
            block = self._blocks[region][0]
            if off + nbytes <= block.numel():
                self._cursor = (region, -(-(off + nbytes) // _ALIGN) * _ALIGN)
                return region, off
        size = max(self._block_size, -(-nbytes // _ALIGN) * _ALIGN)
        region = f"b{self._counter}"
        self._counter += 1
        block = torch.empty(size, dtype=torch.uint8, device=self._device)
        self._blocks[region] = (block, self._agent.register(block))
        self._cursor = (region, -(-nbytes // _ALIGN) * _ALIGN)
        return region, 0

    def _relocate(self) -> None:
        """The layout changed: copy what this sync put so far into fresh blocks."""
        self.changed = True
        old, self._cursor = self._entries, None
        self._entries = []
        stale = dict(self._blocks)
        for name, shape, wire, start, stop, region, offset, *box in old:
            if region not in stale:       # served from its own storage
                self._entries.append((name, shape, wire, start, stop, region, offset, *box))
                continue
            nbytes = (stop - start) * torch.empty((), dtype=_dtype(wire)).element_size()
            new, off = self._alloc(nbytes)
            if nbytes:
                self._blocks[new][0][off:off + nbytes].copy_(stale[region][0][offset:offset + nbytes])
            self._entries.append((name, shape, wire, start, stop, new, off, *box))
        for region in stale:
            self._free(region)

    def _drop_unused(self) -> None:
        used = {e[5] for e in self._entries}
        for region in [r for r in self._blocks if r not in used]:
            self._free(region)
        for key in [k for k, (r, _, _) in self._own.items() if r not in used]:
            _, t, reg = self._own.pop(key)
            if self._pipelined:
                self._deferred.append((t, reg))
            else:
                self._agent.deregister(reg)

    def _own_region(self, t: torch.Tensor) -> str:
        key = (t.data_ptr(), t.numel() * t.element_size())
        if key not in self._own:
            self._own[key] = (f"p{key[0]:x}", t, self._agent.register(t))
        return self._own[key][0]

    def _free(self, region: str) -> None:
        block, reg = self._blocks.pop(region)
        if self._pipelined:
            # readers may still be reading it (they started on the expected layout)
            self._deferred.append((block, reg))
        else:
            self._agent.deregister(reg)
        if self._cursor is not None and self._cursor[0] == region:
            self._cursor = None

    def reset(self) -> None:
        """Forget the layout (after a failed sync): the next one is published anew."""
        self._prev, self.digest = [], ""
        self._lasting.reset()

    def close(self) -> None:
        self._pipelined = False
        self.release_deferred()
        for region in list(self._blocks):
            self._free(region)
        for _, _, reg in self._own.values():
            self._agent.deregister(reg)
        self._own, self._prev, self._entries = {}, [], []


def _dtype(name: str) -> torch.dtype:
    from weightsync.core.plan import dtype_from_name
    return dtype_from_name(name)
