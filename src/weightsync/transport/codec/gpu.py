"""Delta encode and apply as device kernels (Triton), many tensors per launch.

Sender (:class:`Encoder`): one *diff* launch per group of tensors (up to
:data:`GROUP_BYTES` of them) reads each new tensor and its base once (each program
:data:`SUB` steps of :data:`BLOCK` elements of one tensor, the next step's loads issued
before the current step's count goes out), compares them
bitwise, and writes the changed positions, new values and old values into a staging area
(at most :func:`~.delta.max_changes` per tensor), counting the changes per tensor; it
updates the base where it changed, so the base equals the new tensor after it. One
readback of the counts per group (taken while the next group runs) sizes the records; a
*pack* launch then copies each tensor's changes into its record and sums their change
digest, and a tiny launch writes the headers. No host work per change, no host sync per
tensor, everything on the caller's current stream.

Receiver (:class:`Decoder`): records are copied into an arena as they arrive; each flush
(a full arena, or the end of the records) *verifies* every staged record against the
tensor it is for (its header, positions in range, and the change digest recomputed from the
positions, the record's values and the values the tensor holds there) and *commits* only
the records that passed, on the device; one readback per receive says which did. A
record that fails leaves its tensor untouched.

Memory: the sender stages at most two groups at a time, each ``(index width + 2 x element
size) / 8`` bytes per element of the group (1 byte per bf16 element), plus the records; the
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
GROUP_BYTES = 512 << 20
#: Most tensors per launch (the kernels find a program's tensor by binary search).
GROUP_TENSORS = 128
_LOG = 7                              # 2**_LOG >= GROUP_TENSORS
#: Receiver: bytes of records verified and committed per flush.
ARENA_BYTES = 256 << 20
BLOCK = 4096                          # elements per diff step
SUB = 1                               # diff steps per program (the next one's loads overlap)
WARPS = 4                             # warps per program of every kernel here
EB = 2048                             # record entries per pack / verify / commit program
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    """Whether tensors on ``device`` go through these kernels."""
    return triton is not None and (device.type == "cuda" or (INTERPRET and device.type == "cpu"))


if triton is not None:
    _ELEM = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
    _UELEM = {1: tl.uint8, 2: tl.uint16, 4: tl.uint32, 8: tl.uint64}
    _POS = {4: tl.int32, 8: tl.int64}

    @triton.jit
    def _find(starts, T, pid, LOG: tl.constexpr):
        """The largest t < T with starts[t] <= pid (starts ascending)."""
        t = pid * 0
        for i in tl.static_range(LOG):
            cand = t + (1 << (LOG - 1 - i))
            s = tl.load(starts + tl.minimum(cand, T - 1))
            t = tl.where((cand < T) & (s <= pid), cand, t)
        return t

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
    def _diff(tab, starts, T, counts, ELEM: tl.constexpr, IW: tl.constexpr,
              BLOCK: tl.constexpr, SUB: tl.constexpr, LOG: tl.constexpr,
              ALIGNED: tl.constexpr):
        # a program diffs SUB blocks of BLOCK elements of one tensor, loading block i + 1
        # before it reports block i (the count's atomic round trip then overlaps the
        # loads); lane offsets are 32-bit from the program's start (64-bit lanes spill)
        pid = tl.program_id(0)
        t = _find(starts, T, pid, LOG)
        row = tab + t * 8
        n = tl.load(row + 2)
        cap = tl.load(row + 6)
        first = (pid - tl.load(starts + t)).to(tl.int64) * (BLOCK * SUB)
        new = tl.load(row).to(tl.pointer_type(ELEM)) + first
        base = tl.load(row + 1).to(tl.pointer_type(ELEM)) + first
        if ALIGNED:
            new = tl.multiple_of(new, 16)
            base = tl.multiple_of(base, 16)
        lim = tl.minimum(n - first, BLOCK * SUB).to(tl.int32)   # elements of this program
        offs = tl.arange(0, BLOCK)
        if BLOCK <= lim:                  # whole blocks load unmasked (vectorized)
            a = tl.load(new + offs)
            c = tl.load(base + offs)
        else:
            a = tl.load(new + offs, mask=offs < lim, other=0)
            c = tl.load(base + offs, mask=offs < lim, other=0)
        for i in tl.static_range(SUB):
            at_ = i * BLOCK
            nxt = offs + (at_ + BLOCK)
            if i + 1 < SUB:
                if at_ + 2 * BLOCK <= lim:
                    a_next = tl.load(new + nxt)
                    c_next = tl.load(base + nxt)
                else:
                    a_next = tl.load(new + nxt, mask=nxt < lim, other=0)
                    c_next = tl.load(base + nxt, mask=nxt < lim, other=0)
            ne = (a != c) & (offs + at_ < lim)
            cnt = tl.sum(ne.to(tl.int32), axis=0)
            if cnt > 0:
                got = tl.atomic_add(counts + t, cnt.to(tl.int64))
                dst = tl.cumsum(ne.to(tl.int32), axis=0) - 1
                keep = ne & (dst < tl.minimum(tl.maximum(cap - got, 0), BLOCK).to(tl.int32))
                if IW == 4:
                    pos_out = tl.load(row + 3).to(tl.pointer_type(tl.int32)) + got
                    tl.store(pos_out + dst, offs + (first.to(tl.int32) + at_), mask=keep)
                else:
                    pos_out = tl.load(row + 3).to(tl.pointer_type(tl.int64)) + got
                    tl.store(pos_out + dst, offs.to(tl.int64) + (first + at_), mask=keep)
                new_out = tl.load(row + 4).to(tl.pointer_type(ELEM)) + got
                old_out = tl.load(row + 5).to(tl.pointer_type(ELEM)) + got
                tl.store(new_out + dst, a, mask=keep)
                tl.store(old_out + dst, c, mask=keep)
                tl.store(base + at_ + offs, a, mask=ne)
            if i + 1 < SUB:
                a = a_next
                c = c_next

    @triton.jit
    def _pack(tab, starts, T, digs, ELEM: tl.constexpr, UELEM: tl.constexpr,
              POS: tl.constexpr, IW: tl.constexpr, EB: tl.constexpr, LOG: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        t = _find(starts, T, pid, LOG)
        row = tab + t * 8
        rec = tl.load(row)
        pos_in = tl.load(row + 1).to(tl.pointer_type(POS))
        new_in = tl.load(row + 2).to(tl.pointer_type(ELEM))
        old_in = tl.load(row + 3).to(tl.pointer_type(ELEM))
        m = tl.load(row + 4)
        cap = tl.load(row + 5)
        j = (pid - tl.load(starts + t)) * EB + tl.arange(0, EB)
        live = j < m
        inside = j < cap
        p = tl.load(pos_in + j, mask=live, other=0)
        v = tl.load(new_in + j, mask=live, other=0)
        o = tl.load(old_in + j, mask=live, other=0)
        tl.store((rec + 64).to(tl.pointer_type(POS)) + j, p, mask=inside)
        tl.store((rec + 64 + cap * IW).to(tl.pointer_type(ELEM)) + j, v, mask=inside)
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
    def _verify(tab, starts, T, digs, bad, ELEM: tl.constexpr, UELEM: tl.constexpr,
                POS: tl.constexpr, IW: tl.constexpr, EB: tl.constexpr, LOG: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        t = _find(starts, T, pid, LOG)
        row = tab + t * 8
        rec = tl.load(row)
        dest = tl.load(row + 1).to(tl.pointer_type(ELEM))
        n = tl.load(row + 2)
        cap = tl.load(row + 3)
        m = tl.minimum(tl.maximum(tl.load((rec + 24).to(tl.pointer_type(tl.int64))), 0), cap)
        j = (pid - tl.load(starts + t)) * EB + tl.arange(0, EB)
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
    def _commit(tab, starts, T, ok, ELEM: tl.constexpr, POS: tl.constexpr,
                IW: tl.constexpr, EB: tl.constexpr, LOG: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        t = _find(starts, T, pid, LOG)
        if tl.load(ok + t) != 0:
            row = tab + t * 8
            rec = tl.load(row)
            dest = tl.load(row + 1).to(tl.pointer_type(ELEM))
            cap = tl.load(row + 3)
            m = tl.load((rec + 24).to(tl.pointer_type(tl.int64)))
            j = (pid - tl.load(starts + t)) * EB + tl.arange(0, EB)
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


def _starts(blocks: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """Each tensor's first program (ascending) and the programs in all."""
    first = np.zeros(len(blocks), dtype=np.int64)
    if len(blocks) > 1:
        np.cumsum(blocks[:-1], out=first[1:])
    return _table(list(first), 1, device).view(-1), int(sum(blocks))


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
class _Group:
    items: list                     # (key, new, base)
    counts: torch.Tensor
    staged: dict                    # (k, iw) -> (indices into items, staging tensors, offsets)
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
        device, :func:`~.delta.deltable`); each base equals its new tensor behind it."""
        device = items[0][1].device
        counts = torch.zeros(len(items), dtype=torch.int64, device=device)
        classes: dict[tuple, list[int]] = {}
        for i, (_, new, _) in enumerate(items):
            classes.setdefault((new.element_size(), _delta.index_width(new.numel())),
                               []).append(i)
        staged = {}
        for (k, iw), idx in classes.items():
            caps = [_delta.max_changes(items[i][1].numel()) for i in idx]
            total = sum(caps)
            pos = torch.empty(total, dtype=torch.int32 if iw == 4 else torch.int64,
                              device=device)
            vals = torch.empty(total, dtype=_elem_view(items[idx[0]][1]).dtype, device=device)
            olds = torch.empty_like(vals)
            offsets = [0]
            for c in caps[:-1]:
                offsets.append(offsets[-1] + c)
            rows, blocks, aligned = [], [], True
            for i, cap, off in zip(idx, caps, offsets):
                new, base = items[i][1], items[i][2]
                n = new.numel()
                rows.append([_elem_view(new).data_ptr(), _elem_view(base).data_ptr(), n,
                             pos.data_ptr() + off * iw, vals.data_ptr() + off * k,
                             olds.data_ptr() + off * k, cap, 0])
                blocks.append(math.ceil(n / (BLOCK * SUB)))
                aligned &= new.data_ptr() % 16 == 0 and base.data_ptr() % 16 == 0
            # the programs' counts go to the group's slots of these tensors
            sub = counts if len(idx) == len(items) else torch.zeros(len(idx), dtype=torch.int64,
                                                                    device=device)
            starts, grid = _starts(blocks, device)
            _diff[(grid,)](_table(rows, 8, device), starts, len(idx), sub, ELEM=_ELEM[k],
                           IW=iw, BLOCK=BLOCK, SUB=SUB, LOG=_LOG, ALIGNED=aligned,
                           num_warps=WARPS)
            if sub is not counts:
                counts[torch.tensor(idx, device=device)] = sub
            staged[(k, iw)] = (idx, pos, vals, olds, offsets)
        return _Group(items, counts, staged, _Readback(counts))

    def finish(self, group: _Group) -> list[Encoded]:
        """The records of a launched group, in its order (waits for its counts)."""
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
        for (k, iw), (idx, pos, vals, olds, offsets) in group.staged.items():
            rows, blocks, heads = [], [], []
            for i, off in zip(idx, offsets):
                if not sizes[i]:
                    continue
                new, m = items[i][1], counts[i]
                e = _delta.entries_for(m)
                rec_at = out.data_ptr() + starts_of[i]
                rows.append([rec_at, pos.data_ptr() + off * iw, vals.data_ptr() + off * k,
                             olds.data_ptr() + off * k, m, e, 0, 0])
                blocks.append(math.ceil(e / EB))
                words = np.frombuffer(_delta.header_bytes(_delta.INDEX, new.dtype, new.numel(),
                                                          m, e, 0), dtype=np.int64)
                heads.append([rec_at, *words.tolist()])
            if not rows:
                continue
            digs = torch.zeros(len(rows), dtype=torch.int64, device=device)
            starts, grid = _starts(blocks, device)
            if grid:
                _pack[(grid,)](_table(rows, 8, device), starts, len(rows), digs, ELEM=_ELEM[k],
                               UELEM=_UELEM[k], POS=_POS[iw], IW=iw, EB=EB, LOG=_LOG,
                               num_warps=WARPS)
            _heads[(len(rows),)](_table(heads, 9, device), digs)
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
        # the kernels find a program's record by a binary search over at most
        # GROUP_TENSORS of them: one launch per GROUP_TENSORS records
        chunks = [((k, iw), idx[at: at + GROUP_TENSORS])
                  for (k, iw), idx in classes.items() for at in range(0, len(idx), GROUP_TENSORS)]
        for (k, iw), idx in chunks:
            rows, blocks = [], []
            for i in idx:
                s = staged[i]
                w = np.frombuffer(_delta.header_bytes(_delta.INDEX, s.dest.dtype,
                                                      s.dest.numel(), 0, 0, 0)[:16],
                                  dtype=np.int64)
                rows.append([base + s.at, _elem_view(s.dest).data_ptr(), s.dest.numel(),
                             s.entries, int(w[0]), int(w[1]), 0, 0])
                blocks.append(max(1, math.ceil(s.entries / EB)))
            tab = _table(rows, 8, device)
            starts, grid = _starts(blocks, device)
            digs = torch.zeros(len(idx), dtype=torch.int64, device=device)
            bad = torch.zeros(len(idx), dtype=torch.int32, device=device)
            sub = torch.zeros(len(idx), dtype=torch.int32, device=device)
            kw = dict(ELEM=_ELEM[k], POS=_POS[iw], IW=iw, EB=EB, LOG=_LOG, num_warps=WARPS)
            _verify[(grid,)](tab, starts, len(idx), digs, bad, UELEM=_UELEM[k], **kw)
            _judge[(len(idx),)](tab, digs, bad, sub)
            _commit[(grid,)](tab, starts, len(idx), sub, **kw)
            ok[torch.tensor(idx, device=device)] = sub
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
