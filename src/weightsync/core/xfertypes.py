"""The data of a compiled transfer plan: what trainer ranks hold (:class:`HeldRange`,
:class:`HeldBox`, :class:`SourceLayout`), what rollout workers want (:class:`Want`, :class:`DestLayout`),
and the result (:class:`Read`, :class:`TransferPlan`: serializable, digested, printable).

Validated on construction (malformed values are ``ValueError``); range and coverage
problems are :func:`weightsync.core.xferplan.compile_plan`'s to report. Imported through
:mod:`weightsync.core.xferplan` by the nixl backend and the ``weightsync plan`` tool.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from weightsync.core.plan import DTYPES, itemsize

__all__ = ["HeldRange", "HeldBox", "SourceLayout", "Want", "DestLayout", "Keep", "Read", "TransferPlan",
           "PLAN_FORMAT"]

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


def _box(v: Any, what: str, low: int | None = None) -> tuple[tuple[int, int], ...]:
    """A box: ``(start, stop)`` integer pairs, one per dimension."""
    pairs = _seq(v, what)
    if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
        raise ValueError(f"{what} must hold (start, stop) pairs")
    return tuple((_int(a, what, low), _int(b, what, low)) for a, b in pairs)


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
        if isinstance(kind, (type, tuple)):
            v = _seq(v, what)
            if not all(isinstance(x, kind) for x in v):
                names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple)
                                                          else (kind,)))
                raise ValueError(f"{what} must hold {names} items, got {v!r}")
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
class HeldBox:
    """Slice ``box`` (a ``(start, stop)`` per dimension) of the full tensor ``name``, held
    row-major and contiguous by one rank in memory region ``region`` from byte ``offset``
    on: a tensor-parallel shard split on a dimension other than the first (a row-parallel
    weight's columns), or one block of a 2-D mesh (FSDP2 rows of a TP shard)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    box: tuple[tuple[int, int], ...]
    region: str
    offset: int

    def __post_init__(self) -> None:  # box vs shape: checked by compile_plan
        _norm(self, name="str", shape="shape", dtype="dtype", region="str", offset="int")
        object.__setattr__(self, "box", _box(self.box, f"HeldBox({self.name!r}).box"))

    @property
    def numel(self) -> int:
        return math.prod(max(b - a, 0) for a, b in self.box)


@dataclass(frozen=True, kw_only=True)
class SourceLayout:
    """What one trainer rank serves: contiguous element ranges and boxes of tensors."""

    rank: int
    held: tuple[HeldRange | HeldBox, ...]

    def __post_init__(self) -> None:
        _norm(self, rank="nat", held=(HeldRange, HeldBox))


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
        object.__setattr__(self, "box", _box(self.box, f"Want({self.name!r}).box"))

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


@dataclass(frozen=True, kw_only=True)
class Keep:
    """What a receiver keeps of each tensor: ``boxes[name]`` are the boxes (a ``(start,
    stop)`` per dimension of the full tensor) it needs, ``()`` for none; a name absent
    from ``boxes`` is kept whole. ``notes`` go into the plan (e.g. why a tensor is whole)."""

    boxes: Mapping[str, tuple[tuple[tuple[int, int], ...], ...]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.boxes, Mapping):
            raise ValueError(f"Keep.boxes must be a mapping of name -> boxes, got "
                             f"{type(self.boxes).__name__}")
        norm = {}
        for name, boxes in self.boxes.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"Keep.boxes: a name must be a non-empty string, got {name!r}")
            what = f"Keep.boxes[{name!r}]"
            norm[name] = tuple(_box(box, what, 0) for box in _seq(boxes, what))
        object.__setattr__(self, "boxes", norm)
        _norm(self, notes=str)

    def of(self, name: str, shape: Sequence[int]) -> tuple[tuple[tuple[int, int], ...], ...]:
        """The boxes kept of ``name`` (the whole tensor when it is not listed)."""
        got = self.boxes.get(name)
        return (tuple((0, int(d)) for d in shape),) if got is None else got


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
