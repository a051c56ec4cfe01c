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

import hashlib
import json
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from weightsync.core.errors import PlanMismatch
from weightsync.core.plan import DTYPES, itemsize

__all__ = ["HeldRange", "SourceLayout", "Want", "DestLayout", "Read", "TransferPlan",
           "compile_plan", "PLAN_FORMAT"]

PLAN_FORMAT = "weightsync.xferplan/1"
_READ_FIELDS = ("src_rank", "src_region", "src_offset", "nbytes", "dst_worker", "dst",
                "dst_offset", "cast", "src_dtype", "dst_dtype")
_READ_ROW = operator.attrgetter(*_READ_FIELDS)
_I64 = np.int64
_LOW = {"int": None, "nat": 0, "pos": 1}


def _int(v: Any, what: str, low: int | None = None) -> int:
    if isinstance(v, bool) or not hasattr(type(v), "__index__"):
        raise ValueError(f"{what} must be an integer, got {v!r}")
    if low is not None and operator.index(v) < low:
        raise ValueError(f"{what} must be >= {low}, got {v}")
    return operator.index(v)


def _seq(v: Any, what: str) -> tuple:
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise ValueError(f"{what} must be a sequence, got {v!r}")
    return tuple(v)


def _norm(obj: Any, **kinds: Any) -> None:
    """Check and normalize fields of a frozen dataclass: ``field=kind``, kind one of
    "str" (non-empty), "dtype", "shape", "int"/"nat"/"pos" (any/>=0/>0) or an item type."""
    for k, kind in kinds.items():
        v, what = getattr(obj, k), f"{type(obj).__name__}.{k}"
        if kind == "str" and (not isinstance(v, str) or not v):
            raise ValueError(f"{what} must be a non-empty string, got {v!r}")
        if kind == "dtype" and (not isinstance(v, str) or v not in DTYPES):
            raise ValueError(f"{what}: unknown dtype {v!r}")
        if kind in _LOW:
            v = _int(v, what, _LOW[kind])
        if kind == "shape":
            v = tuple(_int(d, what, 0) for d in _seq(v, what))
        if isinstance(kind, type):
            v = _seq(v, what)
            if not all(isinstance(x, kind) for x in v):
                raise ValueError(f"{what} must hold {kind.__name__} items, got {v!r}")
        object.__setattr__(obj, k, v)


@dataclass(frozen=True, kw_only=True)
class HeldRange:
    """Elements ``[start, stop)`` of the flattened full tensor ``name``, held contiguously
    by one rank in memory region ``region`` from byte ``offset`` on."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    start: int
    stop: int
    region: str
    offset: int

    def __post_init__(self) -> None:  # ranges vs shape: checked by compile_plan
        _norm(self, name="str", shape="shape", dtype="dtype", start="int", stop="int",
              region="str", offset="int")


@dataclass(frozen=True, kw_only=True)
class SourceLayout:
    """What one trainer rank serves."""

    rank: int
    held: tuple[HeldRange, ...]

    def __post_init__(self) -> None:
        _norm(self, rank="nat", held=HeldRange)


@dataclass(frozen=True, kw_only=True)
class Want:
    """Slice ``box`` (a ``(start, stop)`` per dimension) of tensor ``name``, laid row-major
    in buffer ``dest`` from byte ``offset`` on as ``dtype``; ``shape``: the full shape the
    destination expects (None: the trainer's)."""

    name: str
    dtype: str
    box: tuple[tuple[int, int], ...]
    dest: str
    offset: int
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _norm(self, name="str", dtype="dtype", dest="str", offset="int")
        if self.shape is not None:
            _norm(self, shape="shape")
        pairs = _seq(self.box, "Want.box")
        if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
            raise ValueError(f"Want({self.name!r}).box must hold (start, stop) pairs")
        object.__setattr__(self, "box", tuple((_int(a, "Want.box"), _int(b, "Want.box"))
                                              for a, b in pairs))

    @property
    def numel(self) -> int:
        return math.prod(max(b - a, 0) for a, b in self.box)


@dataclass(frozen=True, kw_only=True)
class DestLayout:
    """What one rollout worker wants; ``notes`` pass through into the plan."""

    worker: str
    wants: tuple[Want, ...]
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _norm(self, worker="str", wants=Want, notes=str)


@dataclass(frozen=True, kw_only=True, slots=True)
class Read:
    """One READ of ``nbytes`` from ``src_rank``'s ``src_region`` at ``src_offset`` into
    buffer ``dst`` of worker ``dst_worker`` at ``dst_offset``."""

    src_rank: int
    src_region: str
    src_offset: int
    nbytes: int
    dst_worker: str
    dst: str
    dst_offset: int
    cast: bool = False
    src_dtype: str | None = None
    dst_dtype: str | None = None

    def __post_init__(self) -> None:
        r, so, n, do, a, b, c = (self.src_rank, self.src_offset, self.nbytes, self.dst_offset,
                                 self.src_region, self.dst_worker, self.dst)
        if not (type(r) is int and type(so) is int and type(n) is int and type(do) is int
                and r >= 0 and so >= 0 and n > 0 and do >= 0 and type(a) is str and a != ""
                and type(b) is str and b != "" and type(c) is str and c != ""):  # fast path
            _norm(self, src_rank="nat", src_offset="nat", nbytes="pos", dst_offset="nat",
                  src_region="str", dst_worker="str", dst="str")
        if type(self.cast) is not bool:
            raise ValueError(f"Read.cast must be a bool, got {self.cast!r}")
        if self.cast:
            _norm(self, src_dtype="dtype", dst_dtype="dtype")
            if self.nbytes % itemsize(self.src_dtype):
                raise ValueError("cast Read.nbytes is not a whole number of elements")
        elif self.src_dtype is not None or self.dst_dtype is not None:
            raise ValueError("Read.src_dtype/dst_dtype are only set on cast reads")

    @property
    def dst_nbytes(self) -> int:
        """Bytes written in the destination buffer (not nbytes on a cast read)."""
        if not self.cast:
            return self.nbytes
        return self.nbytes // itemsize(self.src_dtype) * itemsize(self.dst_dtype)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


@dataclass(frozen=True, kw_only=True)
class TransferPlan:
    """Compiled reads (sorted by dst_worker, dst, dst_offset), what they were compiled for
    (held tensors, source ranks, workers) and notes; ``digest`` names all of it."""

    reads: tuple[Read, ...]
    notes: tuple[str, ...] = ()
    tensors: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    ranks: tuple[int, ...] = ()
    workers: tuple[str, ...] = ()
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        _norm(self, reads=Read, notes=str, workers=str, tensors=tuple)
        ranks = tuple(_int(r, "TransferPlan.ranks", 0) for r in _seq(self.ranks, "ranks"))
        if not all(len(t) == 3 and isinstance(t[0], str) and t[2] in DTYPES
                   for t in self.tensors):
            raise ValueError("TransferPlan.tensors holds (name, shape, dtype) triples")
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "tensors", tuple((n, tuple(_int(d, n, 0) for d in _seq(s, n)),
                                                   t) for n, s, t in self.tensors))
        body = json.dumps(self._canonical(), sort_keys=True, separators=(",", ":"))
        object.__setattr__(self, "digest", hashlib.sha256(body.encode()).hexdigest())

    def _canonical(self) -> dict:
        return {"format": PLAN_FORMAT, "read_fields": list(_READ_FIELDS),
                "reads": [list(_READ_ROW(r)) for r in self.reads], "notes": list(self.notes),
                "tensors": [[n, list(s), d] for n, s, d in self.tensors],
                "ranks": list(self.ranks), "workers": list(self.workers)}

    def to_dict(self) -> dict:
        """A JSON-able dict; :meth:`from_dict` rebuilds an equal plan."""
        return {**self._canonical(), "digest": self.digest}

    @classmethod
    def from_dict(cls, d: Mapping) -> TransferPlan:
        """Inverse of :meth:`to_dict`; ``ValueError`` on any malformed or altered input."""
        keys = {"format", "read_fields", "reads", "notes", "tensors", "ranks", "workers",
                "digest"}
        if not isinstance(d, Mapping) or set(d) != keys:
            raise ValueError(f"a transfer plan dict has exactly the keys {sorted(keys)}")
        try:
            if d["format"] != PLAN_FORMAT or list(d["read_fields"]) != list(_READ_FIELDS):
                raise ValueError(f"not a {PLAN_FORMAT} plan (format or read_fields)")
            if not all(isinstance(r, list) and len(r) == len(_READ_FIELDS) for r in d["reads"]):
                raise ValueError(f"each read is a list of the {len(_READ_FIELDS)} read_fields")
            plan = cls(reads=tuple(Read(**dict(zip(_READ_FIELDS, r))) for r in d["reads"]),
                       notes=d["notes"], tensors=tuple(tuple(t) for t in d["tensors"]),
                       ranks=d["ranks"], workers=d["workers"])
        except TypeError as e:
            raise ValueError(f"malformed transfer plan: {e}") from None
        if plan.digest != d["digest"]:
            raise ValueError("transfer plan digest does not match its content")
        return plan

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.reads)

    def _tally(self, attrs: tuple[str, ...], init: Sequence = (), count: bool = False) -> dict:
        out, key = dict.fromkeys(init, 0), operator.attrgetter(*attrs)
        for r in self.reads:
            out[key(r)] = out.get(key(r), 0) + (1 if count else r.nbytes)
        return out

    def bytes_per_source(self) -> dict[int, int]:
        return self._tally(("src_rank",), self.ranks)

    def bytes_per_dest(self) -> dict[str, int]:
        return self._tally(("dst_worker",), self.workers)

    def bytes_per_pair(self) -> dict[tuple[int, str], int]:
        """Bytes per (source rank, destination worker) pair that has reads."""
        return dict(sorted(self._tally(("src_rank", "dst_worker")).items()))

    def reads_for(self, worker: str) -> list[Read]:
        return [r for r in self.reads if r.dst_worker == worker]

    def reads_from(self, rank: int) -> list[Read]:
        return [r for r in self.reads if r.src_rank == rank]

    def summary(self) -> str:
        total = self.total_bytes
        lines = [f"transfer plan {self.digest[:12]}: {len(self.reads)} reads, "
                 f"{_human(total)}, {len(self.tensors)} tensors"]
        for title, attr, keys in (("source rank", "src_rank", self.ranks),
                                  ("dest worker", "dst_worker", self.workers)):
            count = self._tally((attr,), keys, count=True)
            lines.append(f"  {title:<14}{'reads':>9}{'bytes':>14}{'share':>8}")
            for k, n in self._tally((attr,), keys).items():
                share = 100.0 * n / total if total else 0.0
                lines.append(f"  {k!s:<14}{count[k]:>9}{_human(n):>14}{share:>7.1f}%")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])

    __str__ = summary


# ---------------------------------------------------------------- compilation

@dataclass
class _Tensor:
    shape: tuple[int, ...]
    dtype: str
    rank: int  # the first rank seen holding it (for messages)
    held: list = field(default_factory=list)  # (start, stop, rank, region, offset)
    segments: list | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


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
    for src in sorted(sources, key=lambda s: s.rank):
        if src.rank in seen:
            problems.append((f"<rank {src.rank}>", "source layout given twice"))
        seen.add(src.rank)
        for h in src.held:
            t = tensors.setdefault(h.name, _Tensor(h.shape, h.dtype, src.rank))
            if (h.shape, h.dtype) != (t.shape, t.dtype):
                problems.append((h.name, f"rank {src.rank} holds it as {h.dtype}{list(h.shape)}"
                                         f" but rank {t.rank} as {t.dtype}{list(t.shape)}"))
            elif not 0 <= h.start <= h.stop <= t.numel:
                problems.append((h.name, f"rank {src.rank} holds elements [{h.start}, "
                                         f"{h.stop}), not within [0, {t.numel}]"))
            elif h.offset < 0:
                problems.append((h.name, f"rank {src.rank} has negative offset {h.offset}"))
            else:
                t.held.append((h.start, h.stop, src.rank, h.region, h.offset))
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


def _segments(t: _Tensor) -> list:
    """Maximal element ranges of one holder set: [(b0, b1, [(rank, region, base)])]."""
    if t.segments is None:
        isz, points = itemsize(t.dtype), {0, t.numel}
        for h in t.held:
            points.update(h[:2])
        bounds, t.segments = sorted(points), []
        for b0, b1 in zip(bounds, bounds[1:]):
            best: dict[int, tuple] = {}
            for start, stop, rank, region, offset in sorted(t.held, key=lambda h: h[2:]):
                if start <= b0 and b1 <= stop and rank not in best:
                    best[rank] = (rank, region, offset - start * isz)
            t.segments.append((b0, b1, [best[r] for r in sorted(best)]))
    return t.segments


def _pieces(wants: list, wid: dict, did: dict, problems: list) -> tuple[dict, list, list]:
    """Columns of pieces (a run cut at holder boundaries), their holder sets, cast pairs.

    ``src`` is the byte offset in the flattened tensor (until a holder is picked);
    ``sisz``/``disz`` are the item sizes on cast rows, 1 on direct (byte-copy) rows."""
    parts: dict[str, list] = {}
    holders: list = []
    casts: list = [None]
    for worker, w, t, cast in wants:
        starts, length = _box_runs(t.shape, w.box)
        sisz, disz, ends = itemsize(t.dtype), itemsize(w.dtype), starts + length
        run_doff = w.offset + np.arange(len(starts), dtype=_I64) * (length * disz)
        casts += [cast] if cast not in casts else []
        cid = casts.index(cast)
        for b0, b1, hs in _segments(t) if len(starts) else ():
            lo, hi = np.searchsorted(ends, b0, "right"), np.searchsorted(starts, b1, "left")
            if lo >= hi:
                continue
            ps, pe = np.maximum(starts[lo:hi], b0), np.minimum(ends[lo:hi], b1)
            if not hs:
                problems.append((w.name, f"worker {worker}: no rank holds elements "
                                         f"[{ps[0]}, {pe[0]}) of the flattened tensor"))
                break
            holders.append(hs)
            cols = {"gid": len(holders) - 1, "src": ps * sisz, "nb": (pe - ps) * sisz,
                    "wid": wid[worker], "did": did[w.dest], "cid": cid,
                    "doff": run_doff[lo:hi] + (ps - starts[lo:hi]) * disz,
                    "sisz": sisz if cid else 1, "disz": disz if cid else 1}
            for c, v in cols.items():
                parts.setdefault(c, []).append(np.broadcast_to(np.asarray(v, _I64), (hi - lo,)))
    names = ("gid", "src", "nb", "wid", "did", "cid", "doff", "sisz", "disz")
    return ({c: np.concatenate(parts[c]) if parts else np.empty(0, _I64) for c in names},
            holders, casts)


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


def _assign(c: dict, holders: list, balance: bool) -> tuple[dict, list[str]]:
    """Pick a holder per piece: forced ones first, then greedy least-loaded, largest first."""
    flat = [h for hs in holders for h in hs] or [(0, "", 0)]
    nh = np.array([len(h) for h in holders] or [1], _I64)
    hstart = np.concatenate(([0], np.cumsum(nh)[:-1])).astype(_I64)
    h_rank, h_base = np.array([h[0] for h in flat], _I64), np.array([h[2] for h in flat], _I64)
    hidx = hstart[c["gid"]]
    multi = np.flatnonzero(nh[c["gid"]] > 1) if balance else np.empty(0, _I64)
    fixed = np.ones(len(hidx), bool)
    fixed[multi] = False
    loads = np.bincount(h_rank[hidx[fixed]], weights=c["nb"][fixed],
                        minlength=int(h_rank.max()) + 1).astype(_I64).tolist()
    keys = [c[k][multi] for k in ("doff", "did", "wid")] + [-c["nb"][multi]]
    order = multi[np.lexsort(keys)]  # largest first; ties by destination (deterministic)
    ranks, starts, counts, chosen = h_rank.tolist(), hstart.tolist(), nh.tolist(), []
    for g, n in zip(c["gid"][order].tolist(), c["nb"][order].tolist()):
        best = starts[g]
        for h in range(best + 1, best + counts[g]):  # holders sorted by rank: ties -> lowest
            if loads[ranks[h]] < loads[ranks[best]]:
                best = h
        loads[ranks[best]] += n
        chosen.append(best)
    hidx[order] = np.array(chosen, _I64)
    regions = sorted({h[1] for h in flat})
    h_reg = np.array([regions.index(h[1]) for h in flat], _I64)
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


def compile_plan(sources: Sequence[SourceLayout], dests: Sequence[DestLayout], *,
                 max_read_bytes: int | None = None, balance: bool = True) -> TransferPlan:
    """Compile the reads that land every want of ``dests`` from the ranks of ``sources``.

    Raises :class:`PlanMismatch` listing every problem of the layouts. ``max_read_bytes``
    caps one read (pieces are cut before balancing, so even one big replicated tensor is
    spread over its holders); ``balance=False`` always reads from the lowest rank.
    """
    if max_read_bytes is not None:
        _int(max_read_bytes, "max_read_bytes", 1)
    problems: list[tuple[str, str]] = []
    tensors = _gather_sources(sources, problems)
    wants = _check_dests(dests, tensors, problems)
    workers = sorted({d.worker for d in dests})
    dnames = sorted({w.dest for d in dests for w in d.wants})
    cols, holders, casts = _pieces(wants, {x: i for i, x in enumerate(workers)},
                                   {x: i for i, x in enumerate(dnames)}, problems)
    _fail(problems)
    if max_read_bytes is not None:
        cols = _split(cols, max_read_bytes)
    cols, regions = _assign(cols, holders, balance)
    cols = _coalesce(cols)
    if max_read_bytes is not None:
        cols = _split(cols, max_read_bytes)
    reads = []
    for rank, reg, src, nb, wid, did, doff, cid in zip(*(cols[k].tolist() for k in (
            "rank", "reg", "src", "nb", "wid", "did", "doff", "cid"))):
        cast = casts[cid] or (None, None)
        reads.append(Read(src_rank=rank, src_region=regions[reg], src_offset=src, nbytes=nb,
                          dst_worker=workers[wid], dst=dnames[did], dst_offset=doff,
                          cast=cid != 0, src_dtype=cast[0], dst_dtype=cast[1]))
    notes = []
    for d in sorted(dests, key=lambda d: d.worker):
        notes += [f"{d.worker}: {n}" for n in d.notes]
        notes += [f"{d.worker}: {w.name} lands as {tensors[w.name].dtype}, cast to {w.dtype}"
                  for w in d.wants if w.dtype != tensors[w.name].dtype]
    return TransferPlan(reads=tuple(reads), notes=tuple(notes),
                        tensors=tuple((n, t.shape, t.dtype) for n, t in sorted(tensors.items())),
                        ranks=tuple(sorted({s.rank for s in sources})), workers=tuple(workers))
