"""Compiled transfer plan of the point-to-point pull backend (NIXL one-sided READs).

Owns the layout arithmetic of a pull sync: trainer ranks hold parts of named tensors in
registered memory regions (:class:`SourceLayout`); rollout workers want hyperrectangle
slices of tensors at given offsets of their landing buffers (:class:`DestLayout`).
:func:`compile_plan` turns the two, once, into coalesced byte-range :class:`Read` s,
balanced over replicas, that are replayed every sync (a sync carries only the version
and ``TransferPlan.digest``). Called by the nixl backend, which executes the reads, and
by the ``weightsync plan`` tool, which prints the summary and predicts times from it.

A cast read (``cast=True``) lands ``nbytes`` of ``src_dtype`` in staging memory, to be
cast to ``dst_dtype`` at ``dst_offset`` of the destination. Bytes reported are wire bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from weightsync.core.errors import PlanMismatch
from weightsync.core.plan import DTYPES, itemsize
from weightsync.core.xfertypes import (PLAN_FORMAT, DestLayout, HeldBox, HeldRange, Keep, Read,
                                       SourceLayout, TransferPlan, Want, _I64, _int)

__all__ = ["HeldRange", "HeldBox", "SourceLayout", "Want", "DestLayout", "Keep", "Read", "TransferPlan",
           "compile_plan", "read_totals", "box_is_run", "cut_boxes", "PLAN_FORMAT"]

@dataclass
class _Tensor:
    shape: tuple[int, ...]
    dtype: str
    rank: int  # the first rank seen holding it (for messages)
    held: list = field(default_factory=list)  # (starts, stops, rank, region, offsets) arrays
    segments: tuple | None = None             # (b0, b1, first gid) once registered

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _Holders:
    """Every holder set of the plan, CSR-style: holder set ``g`` is entries
    ``start[g] : start[g] + count[g]`` of (rank, region id, base), ranks ascending."""

    def __init__(self) -> None:
        self.regions: dict[str, int] = {}
        self._parts: dict[str, list] = {k: [] for k in ("count", "rank", "reg", "base")}
        self.sets = 0
        self._cached: tuple = (-1, ())       # (sets when built, arrays)

    def region(self, name: str) -> int:
        return self.regions.setdefault(name, len(self.regions))

    def add(self, count, rank, reg, base) -> int:
        """Register holder sets (``count`` per set); the gid of the first."""
        first = self.sets
        for k, v in (("count", count), ("rank", rank), ("reg", reg), ("base", base)):
            self._parts[k].append(np.asarray(v, _I64))
        self.sets += len(count)
        return first

    def arrays(self) -> tuple:
        """``(start, count, rank, reg, base)``; one dummy holder when there is none."""
        if self._cached[0] == self.sets:
            return self._cached[1]
        cat = {k: np.concatenate(v) if v else np.empty(0, _I64) for k, v in self._parts.items()}
        if not len(cat["rank"]):
            cat.update(rank=np.zeros(1, _I64), reg=np.zeros(1, _I64), base=np.zeros(1, _I64))
        start = np.concatenate(([0], np.cumsum(cat["count"])[:-1])).astype(_I64)
        self._cached = (self.sets, (start, cat["count"], cat["rank"], cat["reg"], cat["base"]))
        return self._cached[1]


def _fail(problems: list[tuple[str, str]]) -> None:
    """Raise one PlanMismatch naming the tensors first, then a line per problem."""
    if problems:
        problems = sorted(set(problems))
        names = ", ".join(dict.fromkeys(n for n, _ in problems))
        lines = "".join(f"\n  - {n}: {m}" for n, m in problems)
        raise PlanMismatch(f"transfer layouts do not fit, {len(problems)} problem(s) "
                           f"[{names}]:{lines}", phase="plan")


def _gather_sources(sources: Sequence[SourceLayout], problems: list) -> dict[str, _Tensor]:
    tensors: dict[str, _Tensor] = {}
    seen: set[int] = set()
    one = np.ones(1, _I64)
    for src in sorted(sources, key=lambda s: s.rank):
        if src.rank in seen:
            problems.append((f"<rank {src.rank}>", "source layout given twice"))
        seen.add(src.rank)
        for h in src.held:
            t = tensors.setdefault(h.name, _Tensor(h.shape, h.dtype, src.rank))
            boxed = isinstance(h, HeldBox)
            what = f"box {list(h.box)}" if boxed else f"elements [{h.start}, {h.stop})"
            if (h.shape, h.dtype) != (t.shape, t.dtype):
                problems.append((h.name, f"rank {src.rank} holds it as {h.dtype}{list(h.shape)}"
                                         f" but rank {t.rank} as {t.dtype}{list(t.shape)}"))
            elif boxed and (len(h.box) != len(t.shape) or any(
                    not 0 <= a <= b <= n for (a, b), n in zip(h.box, t.shape))):
                problems.append((h.name, f"rank {src.rank} holds {what}, not within "
                                         f"shape {list(t.shape)}"))
            elif not boxed and not 0 <= h.start <= h.stop <= t.numel:
                problems.append((h.name, f"rank {src.rank} holds {what}, not within "
                                         f"[0, {t.numel}]"))
            elif h.offset < 0:
                problems.append((h.name, f"rank {src.rank} has negative offset {h.offset}"))
            elif boxed:
                starts, length = _box_runs(t.shape, h.box)
                offs = h.offset + np.arange(len(starts), dtype=_I64) * (length * itemsize(t.dtype))
                t.held.append((starts, starts + length, src.rank, h.region, offs))
            else:
                t.held.append((h.start * one, h.stop * one, src.rank, h.region, h.offset * one))
    return tensors


def _check_want(w: Want, t: _Tensor | None, problems: list) -> tuple | None | bool:
    """Report the problems of one want; return its cast pair, None (direct) or False."""
    found = [f"negative destination offset {w.offset}"] if w.offset < 0 else []
    if t is None:
        found.append("no trainer rank holds this tensor")
    elif w.shape is not None and w.shape != t.shape:
        found.append(f"shape changed: destination expects {list(w.shape)}, trainer holds "
                     f"{list(t.shape)}")
    if t is not None and w.dtype != t.dtype and not (
            DTYPES[w.dtype].is_floating_point and DTYPES[t.dtype].is_floating_point):
        found.append(f"cannot cast {t.dtype} to {w.dtype}")
    if t is not None and len(w.box) != len(t.shape):
        found.append(f"box has {len(w.box)} dims, tensor {list(t.shape)} has {len(t.shape)}")
    elif t is not None and any(not 0 <= a <= b <= n for (a, b), n in zip(w.box, t.shape)):
        found.append(f"box {list(w.box)} outside shape {list(t.shape)}")
    problems += [(w.name, m) for m in found]
    return False if found else (None if w.dtype == t.dtype else (t.dtype, w.dtype))


def _check_dests(dests: Sequence[DestLayout], tensors: dict, problems: list) -> list:
    """Valid wants as (worker, want, tensor, cast); overlapping destinations reported."""
    out, seen = [], set()
    for d in sorted(dests, key=lambda d: d.worker):
        if d.worker in seen:
            problems.append((f"<worker {d.worker}>", "destination layout given twice"))
        seen.add(d.worker)
        spans = sorted((w.dest, w.offset, w.offset + w.numel * itemsize(w.dtype), w.name)
                       for w in d.wants if w.numel and w.offset >= 0)
        last = None  # the span reaching furthest so far in the current buffer
        for cur in spans:
            if last is not None and last[0] == cur[0] and cur[1] < last[2]:
                problems.append((cur[3], f"worker {d.worker}: bytes [{cur[1]}, {cur[2]}) of "
                                         f"{cur[0]!r} overlap those of {last[3]!r}"))
            if last is None or last[0] != cur[0] or cur[2] > last[2]:
                last = cur
        for w in d.wants:
            cast = _check_want(w, tensors.get(w.name), problems)
            if cast is not False:
                out.append((d.worker, w, tensors[w.name], cast))
    return out


def _box_runs(shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> tuple[Any, int]:
    """Start elements (ascending) and common length of the box's contiguous runs."""
    if any(b <= a for a, b in box) or math.prod(shape) == 0:
        return np.empty(0, _I64), 0
    k = len(shape)
    while k > 0 and box[k - 1] == (0, shape[k - 1]):
        k -= 1  # trailing full dimensions fold into the run
    if k == 0:
        return np.zeros(1, _I64), math.prod(shape)
    strides = [math.prod(shape[j + 1:]) for j in range(len(shape))]
    starts = np.array([box[k - 1][0] * strides[k - 1]], _I64)
    for j in range(k - 2, -1, -1):
        idx = np.arange(box[j][0], box[j][1], dtype=_I64) * strides[j]
        starts = (idx[:, None] + starts[None, :]).ravel()
    return starts, (box[k - 1][1] - box[k - 1][0]) * strides[k - 1]


def _segments(t: _Tensor, reg: _Holders) -> tuple:
    """The tensor's maximal element ranges of one holder set, registered in ``reg``:
    ``(b0, b1, gid of the first, holders per range)``. A rank holding a range twice counts
    once (its first copy by region name and offset); ranges nobody holds get no holder."""
    if t.segments is None:
        isz = itemsize(t.dtype)
        cols = [np.concatenate(c) if t.held else np.empty(0, _I64) for c in (
            [h[0] for h in t.held], [h[1] for h in t.held], [np.full(len(h[0]), h[2], _I64)
                                                               for h in t.held],
            [np.full(len(h[0]), reg.region(h[3]), _I64) for h in t.held],
            [h[4] for h in t.held])]
        s, e, rank, region, off = cols
        keep = e > s
        s, e, rank, region, off = s[keep], e[keep], rank[keep], region[keep], off[keep]
        bounds = np.unique(np.concatenate((s, e, np.array([0, t.numel], _I64))))
        lo, hi = np.searchsorted(bounds, s), np.searchsorted(bounds, e)
        cnt = hi - lo
        piece = np.repeat(np.arange(len(s), dtype=_I64), cnt)
        seg = lo[piece] + np.arange(len(piece), dtype=_I64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        by_name = np.empty(len(reg.regions), _I64)       # region id -> its place by name
        by_name[[reg.regions[n] for n in sorted(reg.regions)]] = np.arange(len(reg.regions))
        order = np.lexsort((off[piece], by_name[region[piece]], rank[piece], seg))
        seg, piece = seg[order], piece[order]
        first = np.ones(len(seg), bool)
        first[1:] = (seg[1:] != seg[:-1]) | (rank[piece][1:] != rank[piece][:-1])
        seg, piece = seg[first], piece[first]
        nseg = len(bounds) - 1
        count = np.bincount(seg, minlength=nseg).astype(_I64)
        gid0 = reg.add(count, rank[piece], region[piece], off[piece] - s[piece] * isz)
        t.segments = (bounds[:-1], bounds[1:], gid0, count)
    return t.segments


def _pieces(wants: list, wid: dict, did: dict, problems: list,
            reg: _Holders) -> tuple[dict, _Holders, list]:
    """Columns of pieces (a run cut at holder boundaries), the holder sets, cast pairs.

    ``src`` is the byte offset in the flattened tensor (until a holder is picked);
    ``sisz``/``disz`` are the item sizes on cast rows, 1 on direct (byte-copy) rows."""
    parts: dict[str, list] = {}
    casts: list = [None]
    for worker, w, t, cast in wants:
        starts, length = _box_runs(t.shape, w.box)
        if not len(starts):
            continue
        sisz, disz, ends = itemsize(t.dtype), itemsize(w.dtype), starts + length
        casts += [cast] if cast not in casts else []
        cid = casts.index(cast)
        b0, b1, gid0, count = _segments(t, reg)
        lo, hi = np.searchsorted(ends, b0, "right"), np.searchsorted(starts, b1, "left")
        cnt = np.maximum(hi - lo, 0)
        empty = np.flatnonzero((cnt > 0) & (count == 0))
        if len(empty):
            j = empty[0]
            problems.append((w.name, f"worker {worker}: no rank holds elements "
                                     f"[{max(starts[lo[j]], b0[j])}, {min(ends[lo[j]], b1[j])})"
                                     " of the flattened tensor"))
            continue
        seg = np.repeat(np.arange(len(b0), dtype=_I64), cnt)
        run = lo[seg] + np.arange(len(seg), dtype=_I64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        ps, pe = np.maximum(starts[run], b0[seg]), np.minimum(ends[run], b1[seg])
        doff = w.offset + run * (length * disz) + (ps - starts[run]) * disz
        n = len(seg)
        cols = {"gid": gid0 + seg, "src": ps * sisz, "nb": (pe - ps) * sisz, "wid": wid[worker],
                "did": did[w.dest], "cid": cid, "doff": doff,
                "sisz": sisz if cid else 1, "disz": disz if cid else 1}
        for c, v in cols.items():
            parts.setdefault(c, []).append(np.broadcast_to(np.asarray(v, _I64), (n,)))
    names = ("gid", "src", "nb", "wid", "did", "cid", "doff", "sisz", "disz")
    return ({c: np.concatenate(parts[c]) if parts else np.empty(0, _I64) for c in names},
            reg, casts)


def _split(c: dict, limit: int) -> dict:
    """Cut rows longer than ``limit`` bytes (cast rows at element boundaries)."""
    chunk = np.where(c["cid"] == 0, limit, np.maximum(limit // c["sisz"], 1) * c["sisz"])
    k = -(-c["nb"] // chunk)
    if len(k) == 0 or k.max() <= 1:
        return c
    idx = np.repeat(np.arange(len(k)), k)
    j = np.arange(len(idx), dtype=_I64) - np.repeat(np.cumsum(k) - k, k)
    out, ch = {name: v[idx] for name, v in c.items()}, chunk[idx]
    out["src"] = out["src"] + j * ch
    out["doff"] = out["doff"] + j * ch // out["sisz"] * out["disz"]
    out["nb"] = np.minimum(ch, out["nb"] - j * ch)
    return out


def _blocks(c: dict, m: Any, hstart: Any, nh: Any, h_rank: Any, h_reg: Any, h_base: Any,
            limit: int | None) -> Any:
    """Block ids (ascending) of the pieces ``m`` (sorted by destination): a block is a run
    of pieces consecutive at the destination that every one of their holders (the same
    ranks) holds consecutively too, so one holder serves a block as one read; cut where it
    would pass ``limit`` bytes (reads stay spread over holders at that size)."""
    if len(m) < 2:
        return np.arange(len(m), dtype=_I64)
    a, b = m[:-1], m[1:]
    ga, gb = c["gid"][a], c["gid"][b]
    dnb = c["nb"] // c["sisz"] * c["disz"]
    join = (c["wid"][a] == c["wid"][b]) & (c["did"][a] == c["did"][b]) & \
        (c["cid"][a] == c["cid"][b]) & (c["doff"][a] + dnb[a] == c["doff"][b]) & \
        (nh[ga] == nh[gb])
    ka = nh[ga]
    for j in range(int(ka.max())):
        at = np.minimum(j, ka - 1)
        ha, hb = hstart[ga] + at, hstart[gb] + at
        join &= (h_rank[ha] == h_rank[hb]) & (h_reg[ha] == h_reg[hb]) & \
            (h_base[ha] + c["src"][a] + c["nb"][a] == h_base[hb] + c["src"][b])
    new = np.concatenate(([True], ~join))
    if limit is not None:
        nb = c["nb"][m]
        cum = np.cumsum(nb)
        first = np.maximum.accumulate(np.where(new, np.arange(len(m)), 0))
        before = cum - nb - (cum[first] - nb[first])       # bytes before it in its block
        sub = before // limit
        new |= np.concatenate(([True], sub[1:] != sub[:-1]))
    return np.cumsum(new) - 1


def _assign(c: dict, reg: _Holders, balance: bool, spread: int = 0,
            prior: Mapping[int, int] | None = None,
            limit: int | None = None) -> tuple[dict, list[str]]:
    """Pick a holder per piece: forced ones first, then greedy least-loaded, largest first,
    a block of pieces at a time (:func:`_blocks`: what one holder would serve as one read,
    e.g. the rows of a box the holders stage contiguously); of equally loaded holders, the
    first in rank order from a position set by ``spread``: its base-``k`` digit sum mod
    ``k`` for ``k`` holders, so receivers ``spread = i`` with ``i`` in steps of a replica
    size that ``k`` divides still cover every position."""
    hstart, nh, h_rank, h_reg, h_base = reg.arrays()
    hidx = hstart[c["gid"]] if len(c["gid"]) else np.empty(0, _I64)
    multi = np.flatnonzero(nh[c["gid"]] > 1) if balance and len(c["gid"]) \
        else np.empty(0, _I64)
    fixed = np.ones(len(hidx), bool)
    fixed[multi] = False
    loads = np.bincount(h_rank[hidx[fixed]], weights=c["nb"][fixed],
                        minlength=int(h_rank.max()) + 1).astype(_I64).tolist()
    for rank, n in (prior or {}).items():
        if rank < len(loads):
            loads[rank] += int(n)
    m = multi[np.lexsort((c["doff"][multi], c["did"][multi], c["wid"][multi]))]
    blk = _blocks(c, m, hstart, nh, h_rank, h_reg, h_base, limit)
    nblk = int(blk[-1]) + 1 if len(m) else 0
    bnb = np.bincount(blk, weights=c["nb"][m], minlength=nblk).astype(_I64)
    head = m[np.flatnonzero(np.concatenate(([True], blk[1:] != blk[:-1])))] if len(m) \
        else np.empty(0, _I64)
    keys = [c[k][head] for k in ("doff", "did", "wid")] + [-bnb]
    order = np.lexsort(keys)  # largest first; ties by destination (deterministic)
    ranks, starts, counts = h_rank.tolist(), hstart.tolist(), nh.tolist()
    pos = np.zeros(nblk, _I64)
    turn: dict[int, int] = {}
    for bi, g, n in zip(order.tolist(), c["gid"][head][order].tolist(), bnb[order].tolist()):
        first, k = starts[g], counts[g]
        if k not in turn:
            x, turn[k] = spread, 0
            while x:
                turn[k], x = turn[k] + x % k, x // k
        best = turn[k] % k
        for j in range(1, k):                 # holders sorted by rank, from that position
            p = (turn[k] + j) % k
            if loads[ranks[first + p]] < loads[ranks[first + best]]:
                best = p
        loads[ranks[first + best]] += n
        pos[bi] = best
    if len(m):
        hidx[m] = hstart[c["gid"][m]] + pos[blk]
    regions = [name for name, _ in sorted(reg.regions.items(), key=lambda kv: kv[1])]
    return dict(c, rank=h_rank[hidx], reg=h_reg[hidx], src=c["src"] + h_base[hidx]), regions


def _coalesce(c: dict) -> dict:
    """Sort by (worker, dest, dst_offset); merge rows contiguous on both sides."""
    order = np.lexsort((c["doff"], c["did"], c["wid"]))
    if not len(order):
        return c
    c = {k: v[order] for k, v in c.items()}
    dnb = c["nb"] // c["sisz"] * c["disz"]
    same = (c["src"][:-1] + c["nb"][:-1] == c["src"][1:]) & (
        c["doff"][:-1] + dnb[:-1] == c["doff"][1:])
    for k in ("rank", "reg", "wid", "did", "cid"):
        same &= c[k][1:] == c[k][:-1]
    first = np.flatnonzero(np.concatenate(([True], ~same)))
    return dict({k: v[first] for k, v in c.items()}, nb=np.add.reduceat(c["nb"], first))


class _Sources:
    """Trainer ranks' layouts checked once, and their holder ranges registered once, for
    one or more compiles against them."""

    def __init__(self, sources: Sequence[SourceLayout]) -> None:
        self.problems: list[tuple[str, str]] = []
        self.tensors = _gather_sources(sources, self.problems)
        self.ranks = tuple(sorted({s.rank for s in sources}))
        self.reg = _Holders()


def _columns(src: _Sources, dests: Sequence[DestLayout], max_read_bytes: int | None,
             balance: bool, spread: int, prior: Mapping[int, int] | None
             ) -> tuple[dict, list[str], list[str], list[str], list]:
    """The coalesced reads of ``dests`` as columns, with the names their indices refer to
    (workers, destination buffers, regions) and the cast pairs; raises PlanMismatch."""
    problems = list(src.problems)
    wants = _check_dests(dests, src.tensors, problems)
    workers = sorted({d.worker for d in dests})
    dnames = sorted({w.dest for d in dests for w in d.wants})
    cols, holders, casts = _pieces(wants, {x: i for i, x in enumerate(workers)},
                                   {x: i for i, x in enumerate(dnames)}, problems, src.reg)
    _fail(problems)
    if max_read_bytes is not None:
        cols = _split(cols, max_read_bytes)
    cols, regions = _assign(cols, holders, balance, spread, prior, max_read_bytes)
    cols = _coalesce(cols)
    if max_read_bytes is not None:
        cols = _split(cols, max_read_bytes)
    return cols, workers, dnames, regions, casts


def _check_args(max_read_bytes: int | None, spread: int) -> None:
    _int(spread, "spread", 0)
    if max_read_bytes is not None:
        _int(max_read_bytes, "max_read_bytes", 1)


def box_is_run(shape: Sequence[int], box: Sequence[tuple[int, int]]) -> bool:
    """Whether ``box`` of a tensor of ``shape`` is one run of its row-major elements (dims
    before its first partial one of extent 1, dims after it full)."""
    shape, box = tuple(shape), tuple(box)
    j = next((d for d, (a, b) in enumerate(box) if (a, b) != (0, shape[d])), len(shape))
    if j < len(shape) and any(b - a != 1 for a, b in box[:j]):
        return False
    return all((a, b) == (0, shape[d]) for d, (a, b) in enumerate(box) if d > j)


def cut_boxes(shape: Sequence[int], held: Sequence[tuple[int, int]],
              cut: Sequence) -> tuple | None:
    """How a source that holds box ``held`` of a tensor stages it when its receivers keep
    the boxes ``cut`` of it (a tensor-parallel split): one piece per box of ``cut`` that
    meets ``held`` (the intersection), each stored contiguously, so a receiver reads its
    box as one run per source. None (stage it as it is) unless the boxes of ``cut`` are
    disjoint, cover the tensor, and one of them at least is not one run already. The
    ``nixl`` trainer's arena and the planner both stage by this."""
    shape, held = tuple(int(d) for d in shape), tuple(held)
    cut = tuple(tuple(c) for c in cut)
    if not shape or not cut or any(len(c) != len(shape) for c in (*cut, held)):
        return None
    if any(not 0 <= a <= b <= n for c in (*cut, held) for (a, b), n in zip(c, shape)):
        return None
    if all(box_is_run(shape, c) for c in cut):
        return None
    if sum(math.prod(b - a for a, b in c) for c in cut) != math.prod(shape):
        return None
    for i, c in enumerate(cut):               # disjoint (with the volumes: a partition)
        for d in cut[i + 1:]:
            if all(max(a, x) < min(b, y) for (a, b), (x, y) in zip(c, d)):
                return None
    out = []
    for c in cut:
        piece = tuple((max(a, x), min(b, y)) for (a, b), (x, y) in zip(c, held))
        if all(a < b for a, b in piece):
            out.append(piece)
    return tuple(out)


def compile_plan(sources: Sequence[SourceLayout], dests: Sequence[DestLayout], *,
                 max_read_bytes: int | None = None, balance: bool = True,
                 spread: int = 0, prior: Mapping[int, int] | None = None) -> TransferPlan:
    """Compile the reads that land every want of ``dests`` from the ranks of ``sources``.

    Raises :class:`PlanMismatch` listing every problem of the layouts. ``max_read_bytes``
    caps one read (pieces are cut before balancing, so even one big replicated tensor is
    spread over its holders); ``balance=False`` always reads from the lowest rank.
    ``spread`` (e.g. the receiver's rank, when each receiver compiles its own plan) picks
    which of equally loaded holders comes first, so receivers that balance alone do not
    all start on the lowest rank of data-parallel replicas holding the same bytes.
    ``prior``: bytes per rank already planned (a plan compiled in parts balances as one).
    """
    _check_args(max_read_bytes, spread)
    src = _Sources(sources)
    cols, workers, dnames, regions, casts = _columns(src, dests, max_read_bytes, balance,
                                                     spread, prior)
    reads = []
    for rank, reg, off, nb, wid, did, doff, cid in zip(*(cols[k].tolist() for k in (
            "rank", "reg", "src", "nb", "wid", "did", "doff", "cid"))):
        cast = casts[cid] or (None, None)
        reads.append(Read(src_rank=rank, src_region=regions[reg], src_offset=off, nbytes=nb,
                          dst_worker=workers[wid], dst=dnames[did], dst_offset=doff,
                          cast=cid != 0, src_dtype=cast[0], dst_dtype=cast[1]))
    notes = []
    tensors = src.tensors
    for d in sorted(dests, key=lambda d: d.worker):
        notes += [f"{d.worker}: {n}" for n in d.notes]
        notes += [f"{d.worker}: {w.name} lands as {tensors[w.name].dtype}, cast to {w.dtype}"
                  for w in d.wants if w.dtype != tensors[w.name].dtype]
    return TransferPlan(reads=tuple(reads), notes=tuple(notes),
                        tensors=tuple((n, t.shape, t.dtype) for n, t in sorted(tensors.items())),
                        ranks=src.ranks, workers=tuple(workers))


def read_totals(sources: Sequence[SourceLayout], dests: Sequence[DestLayout], *,
                max_read_bytes: int | None = None, balance: bool = True,
                spread: Sequence[int] | None = None,
                prior: Sequence[Mapping[int, int] | None] | None = None
                ) -> list[dict[int, tuple[int, int]]]:
    """For each destination layout compiled alone (as each receiver of the pull backend
    compiles its own plan), with ``spread[i]`` and ``prior[i]``: ``{source rank: (bytes,
    reads)}`` of the plan :func:`compile_plan` would return for ``[dests[i]]``, without
    building its reads. The sources are checked and their holder ranges found once. Used
    by the ``weightsync plan`` tool; raises as :func:`compile_plan` does."""
    n = len(dests)
    spread = list(spread) if spread is not None else [0] * n
    prior = list(prior) if prior is not None else [None] * n
    if len(spread) != n or len(prior) != n:
        raise ValueError("spread and prior give one entry per destination layout")
    for sp in spread:
        _check_args(max_read_bytes, sp)
    src = _Sources(sources)
    out = []
    for d, sp, pr in zip(dests, spread, prior):
        cols = _columns(src, [d], max_read_bytes, balance, sp, pr)[0]
        ranks, nbytes = cols["rank"], cols["nb"]
        size = int(ranks.max()) + 1 if len(ranks) else 0
        b = np.bincount(ranks, weights=nbytes, minlength=size)
        c = np.bincount(ranks, minlength=size)
        out.append({int(r): (int(b[r]), int(c[r])) for r in np.flatnonzero(c)})
    return out
