"""Delta encode and apply as device kernels (Triton), many tensors per launch.

Sender (:class:`Encoder`): per group of tensors (up to :data:`GROUP_BYTES`), a *mark*
launch reads each new tensor and its base once, a program per :data:`BLOCK` elements,
and writes which elements differ (a bit each) and how many per block; no program waits on
another. One readback of the counts per group (taken while the next group runs) sizes the
records. A *compact* launch then writes each changed element's position and new value
into its tensor's record (at its block's place among the tensor's changes, from a running
sum of the block counts), its old value into a scratch, and the new value into the base,
so the base equals the new tensor after it; it reads only the changed elements. A
*digest* launch sums each record's change digest, and a tiny launch writes the headers.
No host work per change, no host sync per tensor, everything on the caller's current
stream.

Receiver (:class:`Decoder`): records are copied into an arena as they arrive; each flush
(a full arena, or the end of the records) *verifies* every staged record against the
tensor it is for (its header, positions in range, and the change digest recomputed from the
positions, the record's values and the values the tensor holds there) and *commits* only
the records that passed, on the device; one readback per receive says which did. A
record that fails leaves its tensor untouched.

Memory: the sender holds at most two groups' marks at a time, a bit per element plus 20
bytes per block, and per group the old values of its changes, plus the records; the
receiver an arena of :data:`ARENA_BYTES` (more only for a single larger record).

Under ``TRITON_INTERPRET=1`` the same kernels run on host tensors (tests).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from weightsync.transport.codec import delta as _delta
from weightsync.transport.codec.kernels import int_view

try:  # part of every CUDA build of torch on Linux
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

__all__ = ["available", "Encoder", "Decoder", "encode_one", "apply_one", "GROUP_BYTES",
           "GROUP_TENSORS", "ARENA_BYTES"]

#: Bytes of tensors diffed per launch (the pipeline's step).
GROUP_BYTES = 2 << 30
#: Most tensors per launch.
GROUP_TENSORS = 128
#: Receiver: bytes of records verified and committed per flush.
ARENA_BYTES = 256 << 20
BLOCK = 4096                          # elements per mark / compact program (a power of 2, >= 32)
WARPS = 4                             # warps per program of every kernel here
EB = 2048                             # record entries per digest / verify / commit program
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    """Whether tensors on ``device`` go through these kernels."""
    return triton is not None and (device.type == "cuda" or (INTERPRET and device.type == "cpu"))


if triton is not None:
    _ELEM = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
    _UELEM = {1: tl.uint8, 2: tl.uint16, 4: tl.uint32, 8: tl.uint64}
    _POS = {4: tl.int32, 8: tl.int64}

    @triton.jit
    def _h(pos, bits):
        """kernels.hash_np: h(p, e) in wrapping 64-bit arithmetic."""
        x = bits ^ (pos.to(tl.uint64, bitcast=True) * 0x2545F4914F6CDD1D)
        x = x * 0x1F3D5B79A3C5E7F1
        x = x ^ (x >> 29)
        x = x * 0x4CF5AD432745937F
        x = x ^ (x >> 32)
        return x

    @triton.jit
    def _mark(tab, owner, masks, bcounts, counts, ELEM: tl.constexpr, BLOCK: tl.constexpr,
              ALIGNED: tl.constexpr):
        # one block of BLOCK elements of one tensor: compare it with its base bitwise, and
        # write which elements differ (a bit each) and how many; nothing waits on another
        # program, so the loads set the pace
        pid = tl.program_id(0)
        t = tl.load(owner + pid)
        row = tab + t * 4
        n = tl.load(row + 2)
        first = (pid - tl.load(row + 3)).to(tl.int64) * BLOCK
        new = tl.load(row).to(tl.pointer_type(ELEM)) + first
        base = tl.load(row + 1).to(tl.pointer_type(ELEM)) + first
        if ALIGNED:
            new = tl.multiple_of(new, 16)
            base = tl.multiple_of(base, 16)
        lim = tl.minimum(n - first, BLOCK).to(tl.int32)
        offs = tl.arange(0, BLOCK)            # 32-bit lane offsets (64-bit ones spill)
        if BLOCK <= lim:                      # whole blocks load unmasked (vectorized)
            a = tl.load(new + offs)
            c = tl.load(base + offs)
        else:
            a = tl.load(new + offs, mask=offs < lim, other=0)
            c = tl.load(base + offs, mask=offs < lim, other=0)
        ne = ((a != c) & (offs < lim)).to(tl.int32)
        cnt = tl.sum(ne, axis=0)
        tl.store(bcounts + pid, cnt)
        if cnt > 0:
            bits = tl.reshape(ne, (BLOCK // 32, 32)) << tl.arange(0, 32)[None, :]
            words = tl.sum(bits, axis=1)
            tl.store(masks + pid.to(tl.int64) * (BLOCK // 32) + tl.arange(0, BLOCK // 32),
                     words)
            tl.atomic_add(counts + t, cnt.to(tl.int64))

    @triton.jit
    def _compact(tab, owner, masks, bcounts, cum, ELEM: tl.constexpr, IW: tl.constexpr,
                 BLOCK: tl.constexpr):
        # a marked block of a tensor with a record: its changed elements' positions and new
        # values go to the record (at the block's place among the tensor's changes), the
        # old values to the scratch, and the new values into the base
        pid = tl.program_id(0)
        cnt = tl.load(bcounts + pid)
        if cnt > 0:
            t = tl.load(owner + pid)
            row = tab + t * 8
            rec = tl.load(row)
            if rec != 0:
                fb = tl.load(row + 4)
                cap = tl.load(row + 5)
                start = (pid - fb).to(tl.int64) * BLOCK
                before = tl.load(cum + tl.maximum(fb - 1, 0))
                at = tl.load(cum + pid) - cnt - tl.where(fb > 0, before, 0)
                words = tl.load(masks + pid.to(tl.int64) * (BLOCK // 32)
                                + tl.arange(0, BLOCK // 32))
                ne = tl.reshape((words[:, None] >> tl.arange(0, 32)[None, :]) & 1, (BLOCK,))
                dst = tl.cumsum(ne, axis=0) - 1       # 32-bit, from the block's place
                ne = ne != 0
                offs = tl.arange(0, BLOCK)
                new = tl.load(row + 1).to(tl.pointer_type(ELEM)) + start
                base = tl.load(row + 2).to(tl.pointer_type(ELEM)) + start
                a = tl.load(new + offs, mask=ne, other=0)
                c = tl.load(base + offs, mask=ne, other=0)
                tl.store(base + offs, a, mask=ne)
                if IW == 4:
                    tl.store((rec + 64).to(tl.pointer_type(tl.int32)) + at + dst,
                             offs + start.to(tl.int32), mask=ne)
                else:
                    tl.store((rec + 64).to(tl.pointer_type(tl.int64)) + at + dst,
                             offs.to(tl.int64) + start, mask=ne)
                tl.store((rec + 64 + cap * IW).to(tl.pointer_type(ELEM)) + at + dst, a,
                         mask=ne)
                tl.store(tl.load(row + 6).to(tl.pointer_type(ELEM)) + at + dst, c, mask=ne)

    @triton.jit
    def _digest(tab, owner, digs, ELEM: tl.constexpr, UELEM: tl.constexpr,
                POS: tl.constexpr, IW: tl.constexpr, EB: tl.constexpr):
        # EB entries of a record: their change digest (old values from the scratch), and
        # zeros in the entries past the count
        pid = tl.program_id(0)
        t = tl.load(owner + pid)
        row = tab + t * 8
        rec = tl.load(row)
        m = tl.load(row + 2)
        cap = tl.load(row + 3)
        j = (pid - tl.load(row + 4)).to(tl.int64) * EB + tl.arange(0, EB)
        live = j < m
        pad = (j >= m) & (j < cap)
        pos = (rec + 64).to(tl.pointer_type(POS))
        val = (rec + 64 + cap * IW).to(tl.pointer_type(ELEM))
        p = tl.load(pos + j, mask=live, other=0)
        v = tl.load(val + j, mask=live, other=0)
        o = tl.load(tl.load(row + 1).to(tl.pointer_type(ELEM)) + j, mask=live, other=0)
        tl.store(pos + j, p, mask=pad)
        tl.store(val + j, v, mask=pad)
        pp = p.to(tl.int64)
        d = _h(pp, v.to(UELEM, bitcast=True).to(tl.uint64)) - \
            _h(pp, o.to(UELEM, bitcast=True).to(tl.uint64))
        s = tl.sum(tl.where(live, d, 0), axis=0)
        tl.atomic_add(digs + t, s.to(tl.int64, bitcast=True))

    @triton.jit
    def _heads(tab, digs):
        t = tl.program_id(0)
        row = tab + t * 9
        w = tl.arange(0, 8)
        words = tl.load(row + 1 + w)
        words = tl.where(w == 5, tl.load(digs + t), words)
        tl.store(tl.load(row).to(tl.pointer_type(tl.int64)) + w, words)

    @triton.jit
    def _verify(tab, owner, digs, bad, ELEM: tl.constexpr, UELEM: tl.constexpr,
                POS: tl.constexpr, IW: tl.constexpr, EB: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        t = tl.load(owner + pid)
        row = tab + t * 8
        rec = tl.load(row)
        dest = tl.load(row + 1).to(tl.pointer_type(ELEM))
        n = tl.load(row + 2)
        cap = tl.load(row + 3)
        m = tl.minimum(tl.maximum(tl.load((rec + 24).to(tl.pointer_type(tl.int64))), 0), cap)
        j = (pid - tl.load(row + 6)) * EB + tl.arange(0, EB)
        live = j < m
        p = tl.load((rec + 64).to(tl.pointer_type(POS)) + j, mask=live, other=0).to(tl.int64)
        v = tl.load((rec + 64 + cap * IW).to(tl.pointer_type(ELEM)) + j, mask=live, other=0)
        fits = (p >= 0) & (p < n)
        o = tl.load(dest + p, mask=live & fits, other=0)
        d = _h(p, v.to(UELEM, bitcast=True).to(tl.uint64)) - \
            _h(p, o.to(UELEM, bitcast=True).to(tl.uint64))
        tl.atomic_add(digs + t, tl.sum(tl.where(live, d, 0), axis=0).to(tl.int64, bitcast=True))
        outside = tl.sum((live & ~fits).to(tl.int32), axis=0)
        if outside > 0:
            tl.atomic_add(bad + t, outside)

    @triton.jit
    def _judge(tab, digs, bad, ok):
        t = tl.program_id(0)
        row = tab + t * 8
        words = tl.load(tl.load(row).to(tl.pointer_type(tl.int64)) + tl.arange(0, 8))
        w = tl.arange(0, 8)
        # expected: magic, fmt/enc/dtype/width, numel, -, entries, digest, 0, 0
        want = tl.where(w == 0, tl.load(row + 4), 0)
        want = tl.where(w == 1, tl.load(row + 5), want)
        want = tl.where(w == 2, tl.load(row + 2), want)
        want = tl.where(w == 4, tl.load(row + 3), want)
        want = tl.where(w == 5, tl.load(digs + t), want)
        same = tl.where(w == 3, 0, (words != want).to(tl.int32))
        count = tl.sum(tl.where(w == 3, words, 0), axis=0)
        good = (tl.sum(same, axis=0) == 0) & (count >= 0) & (count <= tl.load(row + 3)) \
            & (tl.load(bad + t) == 0)
        tl.store(ok + t, good.to(tl.int32))

    @triton.jit
    def _commit(tab, owner, ok, ELEM: tl.constexpr, POS: tl.constexpr,
                IW: tl.constexpr, EB: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        t = tl.load(owner + pid)
        if tl.load(ok + t) != 0:
            row = tab + t * 8
            rec = tl.load(row)
            dest = tl.load(row + 1).to(tl.pointer_type(ELEM))
            cap = tl.load(row + 3)
            m = tl.load((rec + 24).to(tl.pointer_type(tl.int64)))
            j = (pid - tl.load(row + 6)) * EB + tl.arange(0, EB)
            live = j < m
            p = tl.load((rec + 64).to(tl.pointer_type(POS)) + j, mask=live, other=0)
            v = tl.load((rec + 64 + cap * IW).to(tl.pointer_type(ELEM)) + j, mask=live,
                        other=0)
            tl.store(dest + p, v, mask=live)


# -- host side ----------------------------------------------------------------------------
def _table(rows: list, width: int, device: torch.device) -> torch.Tensor:
    arr = torch.from_numpy(np.asarray(rows, dtype=np.int64).reshape(-1, width))
    if device.type == "cuda":
        return arr.pin_memory().to(device, non_blocking=True)
    return arr


def _owners(blocks: list[int], device: torch.device) -> tuple[torch.Tensor, list[int], int]:
    """Per program, the index of the tensor it works on (tensor i has ``blocks[i]``
    programs, in order); each tensor's first program; the programs in all."""
    first = np.zeros(len(blocks), dtype=np.int64)
    if len(blocks) > 1:
        np.cumsum(blocks[:-1], out=first[1:])
    grid = int(sum(blocks))
    owner = torch.repeat_interleave(torch.arange(len(blocks), device=device),
                                    _table(blocks, 1, device).view(-1), output_size=grid)
    return owner, first.tolist(), grid


def _elem_view(t: torch.Tensor) -> torch.Tensor:
    return int_view(t)


class _Readback:
    """Device int64 values copied to the host behind the work queued so far."""

    def __init__(self, values: torch.Tensor) -> None:
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event: Any = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = values.clone(), None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def get(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@dataclass
class _Marked:
    """One launch of :func:`_mark`: tensors of one element size and index width."""
    idx: list                       # indices into the group's items
    owner: torch.Tensor
    firsts: list                    # each tensor's first block
    masks: torch.Tensor
    bcounts: torch.Tensor
    cum: torch.Tensor               # running sum of the blocks' counts


@dataclass
class _Group:
    items: list                     # (key, new, base)
    marked: dict                    # (k, iw) -> _Marked
    readback: _Readback


@dataclass
class Encoded:
    """One tensor of a finished group: ``record`` (None: send it dense, its bytes are in
    its base now) and how many elements changed."""
    key: Any
    record: Optional[torch.Tensor]
    changed: int


class Encoder:
    """The sender's diff pipeline (see the module doc): :meth:`launch` a group, then
    :meth:`finish` it (in order) once the next one is launched."""

    def launch(self, items: list[tuple[Any, torch.Tensor, torch.Tensor]]) -> _Group:
        """Queue the diff of ``(key, new, base)`` items (contiguous, same dtype, numel and
        device, :func:`~.delta.deltable`); :meth:`finish` makes each base equal to its new
        tensor."""
        device = items[0][1].device
        counts = torch.zeros(len(items), dtype=torch.int64, device=device)
        classes: dict[tuple, list[int]] = {}
        for i, (_, new, _) in enumerate(items):
            classes.setdefault((new.element_size(), _delta.index_width(new.numel())),
                               []).append(i)
        marked = {}
        for (k, iw), idx in classes.items():
            blocks = [math.ceil(items[i][1].numel() / BLOCK) for i in idx]
            owner, firsts, grid = _owners(blocks, device)
            masks = torch.empty(grid * (BLOCK // 32), dtype=torch.int32, device=device)
            bcounts = torch.empty(grid, dtype=torch.int32, device=device)
            sub = counts if len(idx) == len(items) else torch.zeros(len(idx), dtype=torch.int64,
                                                                    device=device)
            rows, aligned = [], True
            for i, fb in zip(idx, firsts):
                new, base = items[i][1], items[i][2]
                rows.append([_elem_view(new).data_ptr(), _elem_view(base).data_ptr(),
                             new.numel(), fb])
                aligned &= new.data_ptr() % 16 == 0 and base.data_ptr() % 16 == 0
            if grid:
                _mark[(grid,)](_table(rows, 4, device), owner, masks, bcounts, sub,
                               ELEM=_ELEM[k], BLOCK=BLOCK, ALIGNED=aligned, num_warps=WARPS)
            if sub is not counts:
                counts[_table(idx, 1, device).view(-1)] = sub   # no host sync
            marked[(k, iw)] = _Marked(idx, owner, firsts, masks, bcounts,
                                      torch.cumsum(bcounts, 0, dtype=torch.int64))
        return _Group(items, marked, _Readback(counts))

    def finish(self, group: _Group) -> list[Encoded]:
        """The records of a launched group, in its order (waits for its counts); every
        base equals its new tensor behind them."""
        counts = group.readback.get()
        items = group.items
        device = items[0][1].device
        sizes = [_delta.record_size(tuple(new.shape), new.element_size(), m)
                 for (_, new, _), m in zip(items, counts)]
        at, starts_of = 0, {}
        for i, s in enumerate(sizes):
            if s:
                starts_of[i] = at
                at += s
        out = torch.empty(at, dtype=torch.uint8, device=device) if at else None
        for (k, iw), mk in group.marked.items():
            olds_n = sum(counts[i] for i in mk.idx if sizes[i])
            olds = torch.empty(max(olds_n, 1), dtype=_elem_view(items[mk.idx[0]][1]).dtype,
                               device=device)
            rows, drows, dblocks, heads, o_at = [], [], [], [], 0
            for i, fb in zip(mk.idx, mk.firsts):
                new, base = items[i][1], items[i][2]
                if not sizes[i]:          # dense: its base takes the new bytes whole
                    if counts[i]:
                        base.copy_(new)
                    rows.append([0, 0, 0, 0, fb, 0, 0, 0])
                    continue
                m = counts[i]
                e = _delta.entries_for(m)
                rec_at = out.data_ptr() + starts_of[i]
                olds_at = olds.data_ptr() + o_at * k
                o_at += m
                rows.append([rec_at, _elem_view(new).data_ptr(), _elem_view(base).data_ptr(),
                             new.numel(), fb, e, olds_at, 0])
                drows.append([rec_at, olds_at, m, e, 0, 0, 0, 0])
                dblocks.append(math.ceil(e / EB))
                words = np.frombuffer(_delta.header_bytes(_delta.INDEX, new.dtype, new.numel(),
                                                          m, e, 0), dtype=np.int64)
                heads.append([rec_at, *words.tolist()])
            grid = mk.owner.numel()
            if grid and drows:
                _compact[(grid,)](_table(rows, 8, device), mk.owner, mk.masks, mk.bcounts,
                                  mk.cum, ELEM=_ELEM[k], IW=iw, BLOCK=BLOCK, num_warps=WARPS)
            if not drows:
                continue
            owner, firsts, dgrid = _owners(dblocks, device)
            for r, f in zip(drows, firsts):
                r[4] = f
            digs = torch.zeros(len(drows), dtype=torch.int64, device=device)
            if dgrid:
                _digest[(dgrid,)](_table(drows, 8, device), owner, digs, ELEM=_ELEM[k],
                                  UELEM=_UELEM[k], POS=_POS[iw], IW=iw, EB=EB,
                                  num_warps=WARPS)
            _heads[(len(drows),)](_table(heads, 9, device), digs)
        return [Encoded(key, out[starts_of[i]: starts_of[i] + sizes[i]] if sizes[i] else None,
                        m) for i, ((key, _, _), m) in enumerate(zip(items, counts))]


@dataclass
class _Staged:
    key: Any
    dest: torch.Tensor
    at: int
    size: int
    entries: int


@dataclass
class Decoder:
    """The receiver's verify-and-commit pipeline (see the module doc)."""

    device: torch.device
    arena_bytes: int = ARENA_BYTES
    _arena: Optional[torch.Tensor] = None
    _staged: list = field(default_factory=list)
    _used: int = 0
    _flags: list = field(default_factory=list)      # (keys, device ok flags)

    def fits(self, rec: torch.Tensor, dest: torch.Tensor) -> Optional[int]:
        """The entries a record of ``rec.numel()`` bytes holds for ``dest`` (None: it
        cannot be one; the record is then malformed for this tensor)."""
        n, k = dest.numel(), dest.element_size()
        step = _delta.index_width(n) + k
        body = rec.numel() - _delta.HEAD
        if body < 0 or body % step or (body // step) % 8 or k not in (1, 2, 4, 8):
            return None
        return body // step

    def add(self, key: Any, rec: torch.Tensor, dest: torch.Tensor) -> bool:
        """Stage a record for ``dest`` (contiguous, on this device); False if its size
        cannot be a record for it (nothing staged)."""
        entries = self.fits(rec, dest)
        if entries is None:
            return False
        size = (rec.numel() + 63) // 64 * 64
        if self._used + size > self.arena_bytes and self._staged:
            self.flush()
        if self._arena is None or self._arena.numel() < max(size, self.arena_bytes) \
                or (size > self.arena_bytes and self._arena.numel() != size):
            self._arena = torch.empty(max(size, self.arena_bytes), dtype=torch.uint8,
                                      device=self.device)
        self._arena[self._used: self._used + rec.numel()].copy_(rec, non_blocking=True)
        self._staged.append(_Staged(key, dest, self._used, rec.numel(), entries))
        self._used += size
        return True

    def flush(self) -> None:
        """Verify and commit what is staged (queued on the current stream)."""
        staged, self._staged, self._used = self._staged, [], 0
        if not staged:
            return
        device = self.device
        ok = torch.zeros(len(staged), dtype=torch.int32, device=device)
        classes: dict[tuple, list[int]] = {}
        for i, s in enumerate(staged):
            classes.setdefault((s.dest.element_size(), _delta.index_width(s.dest.numel())),
                               []).append(i)
        base = self._arena.data_ptr()
        for (k, iw), idx in classes.items():
            rows, blocks = [], []
            for i in idx:
                s = staged[i]
                w = np.frombuffer(_delta.header_bytes(_delta.INDEX, s.dest.dtype,
                                                      s.dest.numel(), 0, 0, 0)[:16],
                                  dtype=np.int64)
                rows.append([base + s.at, _elem_view(s.dest).data_ptr(), s.dest.numel(),
                             s.entries, int(w[0]), int(w[1]), 0, 0])
                blocks.append(max(1, math.ceil(s.entries / EB)))
            owner, firsts, grid = _owners(blocks, device)
            for r, f in zip(rows, firsts):
                r[6] = f
            tab = _table(rows, 8, device)
            digs = torch.zeros(len(idx), dtype=torch.int64, device=device)
            bad = torch.zeros(len(idx), dtype=torch.int32, device=device)
            sub = ok if len(idx) == len(staged) else torch.zeros(len(idx), dtype=torch.int32,
                                                                 device=device)
            kw = dict(ELEM=_ELEM[k], POS=_POS[iw], IW=iw, EB=EB, num_warps=WARPS)
            _verify[(grid,)](tab, owner, digs, bad, UELEM=_UELEM[k], **kw)
            _judge[(len(idx),)](tab, digs, bad, sub)
            _commit[(grid,)](tab, owner, sub, **kw)
            if sub is not ok:
                ok[_table(idx, 1, device).view(-1)] = sub   # no host sync
        self._flags.append(([s.key for s in staged], ok))

    def results(self) -> list[tuple[Any, bool]]:
        """``(key, committed)`` of every record staged since the last call (flushes; one
        readback)."""
        self.flush()
        flags, self._flags = self._flags, []
        if not flags:
            return []
        got = _Readback(torch.cat([f for _, f in flags])).get()
        keys = [k for ks, _ in flags for k in ks]
        return [(k, bool(v)) for k, v in zip(keys, got)]


def encode_one(new: torch.Tensor, base: torch.Tensor) -> tuple[Optional[torch.Tensor], int]:
    """:func:`~.delta.encode` of one device tensor (``base`` is left alone)."""
    enc = Encoder()
    (got,) = enc.finish(enc.launch([(0, new.contiguous(), base.clone())]))
    return got.record, got.changed


def apply_one(rec: torch.Tensor, dest: torch.Tensor) -> bool:
    """:func:`~.delta.apply` of one record to a device tensor; False if refused (nothing
    written)."""
    dec = Decoder(dest.device)
    if not dec.add(0, rec, dest):
        return False
    ((_, ok),) = dec.results()
    return ok
