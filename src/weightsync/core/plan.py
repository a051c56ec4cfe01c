"""Tensor metadata and the bucket layout of a weight sync.

A *plan* lays an ordered stream of named tensors into buckets of ``bucket_size`` bytes.
The layout is a pure function of the sequence of ``(name, shape, dtype)`` and of the
bucket size, so sender and receivers that see the same sequence compute the same plan;
after the first sync only the bucket indices travel (the plan is replayed).

Packing rule, per tensor of ``n`` bytes, with ``cursor`` the first free byte of the open
bucket, aligned up to ``alignment``:

* ``n == 0``: the tensor takes no space (offset 0, nbytes 0) in the open bucket;
* it fits behind the cursor: it goes there;
* ``n <= bucket_size``: the open bucket is closed and the tensor starts a new one;
* ``n > bucket_size``: the tensor is cut into chunks: the first fills the open bucket from
  the cursor to its end, each next one a whole bucket; its last chunk leaves room for the
  next tensors. Memory per bucket therefore stays bounded whatever the tensor size, and
  every bucket a chunk closes is full (a ring of two slots does not stall on buckets that
  alternate full and part-full).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch

__all__ = [
    "DTYPES",
    "dtype_name",
    "dtype_from_name",
    "itemsize",
    "TensorMeta",
    "Bucket",
    "WeightPlan",
    "PlanBuilder",
    "Replay",
    "ReplayBuilder",
    "build_plan",
    "bucket_digest",
    "plan_signature",
    "DEFAULT_ALIGNMENT",
]

DEFAULT_ALIGNMENT = 256


def _collect_dtypes() -> dict[str, torch.dtype]:
    names = [
        "float64", "float32", "float16", "bfloat16",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64",
        "bool", "complex64", "complex128",
    ]
    out = {}
    for name in names:
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            out[name] = dt
    return out


#: The dtypes a plan may carry (a whitelist: the wire rejects any other name).
DTYPES: dict[str, torch.dtype] = _collect_dtypes()
_NAME_OF = {dt: name for name, dt in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical wire name of a torch dtype; ``ValueError`` for unsupported ones."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be synced by weightsync") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; ``ValueError`` for names off the whitelist."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype name {name!r}") from None


_ITEMSIZE = {name: dt.itemsize for name, dt in DTYPES.items()}


def itemsize(dtype: str) -> int:
    """Bytes per element of a whitelisted dtype name (a dict lookup: on the hot path)."""
    try:
        return _ITEMSIZE[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype name {dtype!r}") from None


@dataclass(frozen=True)
class TensorMeta:
    """Where (a piece of) one tensor lies in one bucket.

    ``offset``/``nbytes`` locate the piece inside the bucket; ``chunk_offset`` is the
    piece's byte offset inside the whole tensor of ``total_nbytes`` bytes. A tensor that
    fits in a bucket is one piece with ``chunk_offset == 0`` and
    ``nbytes == total_nbytes``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int
    chunk_offset: int = 0
    total_nbytes: int = -1

    def __post_init__(self) -> None:
        if self.total_nbytes < 0:
            object.__setattr__(self, "total_nbytes", self.nbytes)

    @property
    def is_chunk(self) -> bool:
        return self.nbytes != self.total_nbytes

    @property
    def is_last_chunk(self) -> bool:
        return self.chunk_offset + self.nbytes == self.total_nbytes

    def to_list(self) -> list:
        return [self.name, list(self.shape), self.dtype, self.offset, self.nbytes,
                self.chunk_offset, self.total_nbytes]

    @classmethod
    def from_list(cls, item: Sequence) -> "TensorMeta":
        name, shape, dtype, offset, nbytes, chunk_offset, total = item
        return cls(name, tuple(shape), dtype, offset, nbytes, chunk_offset, total)


@dataclass(frozen=True)
class Bucket:
    """One bucket: its index in the stream, the bytes used, and the pieces it holds."""

    index: int
    nbytes: int
    entries: tuple[TensorMeta, ...]

    @functools.cached_property
    def digest(self) -> str:
        """Short stable hash of the layout (computed once per Bucket object: a replayed
        plan keeps its Bucket objects, so a steady sync hashes nothing)."""
        h = hashlib.sha256(json.dumps([self.index, self.nbytes,
                                       [e.to_list() for e in self.entries]],
                                      separators=(",", ":")).encode())
        return h.hexdigest()[:24]


def bucket_digest(bucket: Bucket) -> str:
    """Short stable hash of one bucket's layout (checked before a cached layout is used)."""
    return bucket.digest


@dataclass(frozen=True)
class WeightPlan:
    """A complete layout of one tensor stream into buckets."""

    bucket_size: int
    buckets: tuple[Bucket, ...]
    alignment: int = DEFAULT_ALIGNMENT
    signature: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.signature:
            object.__setattr__(self, "signature", plan_signature(self.bucket_size, self.buckets))

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for b in self.buckets for e in b.entries)

    @property
    def names(self) -> list[str]:
        return [e.name for b in self.buckets for e in b.entries if e.chunk_offset == 0]

    @property
    def max_chunk(self) -> int:
        """Largest tensor that is split across buckets (0 if none)."""
        return max((e.total_nbytes for b in self.buckets for e in b.entries if e.is_chunk),
                   default=0)


def plan_signature(bucket_size: int, buckets: Iterable[Bucket]) -> str:
    """Stable hash of a layout: equal across processes and Python runs."""
    h = hashlib.sha256()
    h.update(f"weightsync-plan-v3|{int(bucket_size)}|".encode())
    for b in buckets:
        h.update(b.digest.encode())
    return h.hexdigest()[:32]


class PlanBuilder:
    """Lays tensors into buckets one at a time (streaming; bounded memory).

    ``add`` returns the pieces of the tensor as ``(bucket_index, TensorMeta)``; every
    bucket index below ``open_index`` is closed and can be published.
    """

    def __init__(self, bucket_size: int, alignment: int = DEFAULT_ALIGNMENT) -> None:
        if not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ValueError(f"bucket_size must be a positive int, got {bucket_size!r}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if bucket_size % alignment:
            raise ValueError(f"bucket_size {bucket_size} must be a multiple of {alignment}")
        self.bucket_size = bucket_size
        self.alignment = alignment
        self.open_index = 0
        self._cursor = 0
        self._entries: list[TensorMeta] = []
        self.closed: list[Bucket] = []

    def _close(self) -> None:
        self.closed.append(Bucket(self.open_index, self._cursor, tuple(self._entries)))
        self.open_index += 1
        self._cursor = 0
        self._entries = []

    def add(self, name: str, shape: Sequence[int], dtype: str) -> list[tuple[int, TensorMeta]]:
        shape = tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * itemsize(dtype)
        start = -(-self._cursor // self.alignment) * self.alignment
        if nbytes == 0:
            return self._place(TensorMeta(name, shape, dtype, 0, 0, 0, 0))
        if start + nbytes <= self.bucket_size:
            return self._place(TensorMeta(name, shape, dtype, start, nbytes, 0, nbytes))
        if nbytes <= self.bucket_size:
            if self._entries:
                self._close()
            return self._place(TensorMeta(name, shape, dtype, 0, nbytes, 0, nbytes))
        if start >= self.bucket_size:
            self._close()
            start = 0
        pieces, off = [], 0
        while off < nbytes:
            size = min(self.bucket_size - start, nbytes - off)
            pieces += self._place(TensorMeta(name, shape, dtype, start, size, off, nbytes))
            off += size
            if start + size == self.bucket_size:
                self._close()
            start = 0
        return pieces

    def _place(self, meta: TensorMeta) -> list[tuple[int, TensorMeta]]:
        self._entries.append(meta)
        self._cursor = max(self._cursor, meta.offset + meta.nbytes)
        return [(self.open_index, meta)]

    def finish(self) -> WeightPlan:
        """Close the open bucket (if it holds anything) and return the whole plan."""
        if self._entries:
            self._close()
        return WeightPlan(self.bucket_size, tuple(self.closed), self.alignment)


class Replay:
    """An earlier plan made ready to replay (once per layout, not once per sync): its
    buckets, and per tensor its ``(name, shape, dtype)`` and pieces in arrival order."""

    def __init__(self, buckets: Sequence[Bucket]) -> None:
        self.buckets = tuple(buckets)
        items: list[tuple[tuple, list[tuple[int, TensorMeta]]]] = []
        for b in self.buckets:
            for e in b.entries:
                if e.chunk_offset == 0:
                    items.append(((e.name, e.shape, e.dtype), []))
                items[-1][1].append((b.index, e))
        self.items = items


class ReplayBuilder:
    """A :class:`PlanBuilder` that replays the layout of an earlier sync.

    While the tensors arrive as they did when ``previous`` was built (same names, shapes
    and dtypes in the same order), ``add`` returns that plan's pieces and ``closed`` holds
    that plan's own :class:`Bucket` objects, so nothing is laid out or hashed again. At the
    first difference it becomes a real builder (the items so far are laid out once more)
    and goes on as one; ``replayed`` says whether the whole sync matched.
    """

    def __init__(self, bucket_size: int, alignment: int,
                 previous: "Replay | Sequence[Bucket]") -> None:
        self.bucket_size, self.alignment = bucket_size, alignment
        replay = previous if isinstance(previous, Replay) else Replay(previous)
        self._prev, self._items = replay.buckets, replay.items
        self._k = 0                         # tensors replayed so far
        self._real: Optional[PlanBuilder] = None
        self.closed: list[Bucket] = []

    @property
    def open_index(self) -> int:
        if self._real is not None:
            return self._real.open_index
        return len(self.closed)

    @property
    def replayed(self) -> bool:
        return self._real is None and self._k == len(self._items)

    def add(self, name: str, shape: Sequence[int], dtype: str) -> list[tuple[int, TensorMeta]]:
        if self._real is None:
            if self._k < len(self._items):
                key, pieces = self._items[self._k]
                if key[0] == name and key[2] == dtype and key[1] == tuple(shape):
                    self._k += 1
                    last = pieces[-1][0]
                    if last > len(self.closed):    # every bucket before its last piece's
                        self.closed.extend(self._prev[len(self.closed):last])  # is full
                    return pieces
            self._diverge()
        return self._real.add(name, shape, dtype)

    def _diverge(self) -> None:
        real = PlanBuilder(self.bucket_size, self.alignment)
        for key, _ in self._items[: self._k]:
            real.add(*key)
        # the replay closes buckets no earlier than a real builder would: keep the ones
        # already handed out (equal by value), then the real builder's own
        real.closed = self.closed + real.closed[len(self.closed):]
        self._real = real
        self.closed = real.closed

    def finish(self) -> WeightPlan:
        if self._real is None and self._k == len(self._items):
            self.closed[:] = self._prev
            return WeightPlan(self.bucket_size, self._prev, self.alignment)
        if self._real is None:
            self._diverge()
        return self._real.finish()


def build_plan(
    tensors: Iterable[tuple[str, Sequence[int], str | torch.dtype]],
    bucket_size: int,
    alignment: int = DEFAULT_ALIGNMENT,
) -> WeightPlan:
    """Plan for a whole sequence of ``(name, shape, dtype)`` at once."""
    builder = PlanBuilder(bucket_size, alignment)
    seen: set[str] = set()
    for name, shape, dtype in tensors:
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice")
        seen.add(name)
        builder.add(name, shape, dtype if isinstance(dtype, str) else dtype_name(dtype))
    return builder.finish()
