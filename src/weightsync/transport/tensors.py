"""Small helpers shared by the engines."""

from __future__ import annotations

import bisect
import weakref
import zlib
from typing import Any, AsyncIterator, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from weightsync.core.errors import IntegrityError

try:  # optional, faster
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

__all__ = ["ReplayedLasting", "view_record", "same_view", "aiter_items", "checksum", "CASTABLE", "wire_dtype", "as_bytes", "plain_cpu",
           "resolve_device", "mark_partial", "partial_boxes", "mark_stable", "is_stable", "LastingStorage"]

#: Floating dtypes that the optional ``dtype`` cast applies to (fp8 is left alone).
CASTABLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


async def aiter_items(items: Any, *, shards: bool = False) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Iterate a sync or async iterable of ``(name, tensor)`` with checks; ``shards``: the
    backend serves DTensor shards as they are (else a DTensor is refused)."""
    if hasattr(items, "__aiter__"):
        async for item in items:
            yield _check_item(item, shards)
    else:
        for item in items:
            yield _check_item(item, shards)


def _check_item(item: Any, shards: bool = False) -> tuple[str, torch.Tensor]:
    if not isinstance(item, tuple) or len(item) != 2:
        raise ValueError(f"named_tensors must yield (name, tensor) pairs, got {type(item).__name__}")
    name, tensor = item
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor name must be a non-empty str, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not shards and hasattr(tensor, "full_tensor") and type(tensor).__name__ == "DTensor":
        raise ValueError(f"{name!r}: pass DTensor.full_tensor() (or use weightsync.trainer)")
    return name, tensor


def wire_dtype(tensor: torch.Tensor, cast: torch.dtype | None) -> torch.dtype:
    if cast is not None and tensor.dtype in CASTABLE:
        return cast
    return tensor.dtype


def resolve_device(device: Any) -> torch.device:
    """``device`` with its index made explicit: ``"cuda"`` is the current CUDA device, so
    it compares equal to the device of the tensors made there (``torch.device("cuda") !=
    torch.device("cuda:0")``)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def plain_cpu(t: torch.Tensor) -> bool:
    """A dense, contiguous CPU tensor whose bytes can be moved as they are."""
    return (t.is_cpu and t.layout == torch.strided and t.is_contiguous()
            and not t.is_conj() and not t.is_neg())


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor (any dtype, 0-d included)."""
    return tensor.reshape(-1).view(torch.uint8)


def checksum(buf: torch.Tensor) -> int:
    """Cheap 63-bit checksum of a CPU uint8 tensor's bytes (xxh3 if available, else crc32)."""
    if buf.device.type != "cpu":
        buf = buf.cpu()
    mv = memoryview(buf.numpy())
    if _xxhash is not None:
        return _xxhash.xxh3_64_intdigest(mv) & ((1 << 62) - 1)
    return zlib.crc32(mv)


_PARTIAL = "weightsync_boxes"


def mark_partial(t: torch.Tensor, boxes: tuple) -> torch.Tensor:
    """Mark ``t`` (a fresh tensor the receiver owns) as holding the version's bytes only
    in ``boxes`` (a ``(start, stop)`` per dimension each); its other elements are undefined."""
    setattr(t, _PARTIAL, tuple(boxes))
    return t


_STABLE = "weightsync_stable"


def mark_stable(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` (a tensor a trainer's export yields) as a view of storage the trainer
    keeps from one sync to the next (a parameter, or an FSDP2 parameter's local shard),
    not a temporary: a backend that serves from the caller's storage (``nixl``'s ``auto``)
    may do so from the first sync."""
    setattr(t, _STABLE, True)
    return t


def is_stable(t: torch.Tensor) -> bool:
    """Whether :func:`mark_stable` marked ``t``."""
    return bool(getattr(t, _STABLE, False))


def partial_boxes(t: torch.Tensor) -> tuple | None:
    """The boxes of a tensor marked by :func:`mark_partial`, else None (a whole tensor)."""
    return getattr(t, _PARTIAL, None)


class LastingStorage:
    """Which tensors a caller's iterator yields from storage that outlives the item.

    A backend that reads a yielded tensor after the iterator moved on (``nixl`` serving
    from the caller's storage, ``shm`` letting a receiver read while the next item comes)
    may do so only when the next items cannot write those bytes. :meth:`lasting` says so
    for a tensor the export marked (:func:`mark_stable`), and for one yielded under the
    same name from the same bytes of the same storage, alive since the last sync, that no
    other name of the last sync overlapped (parameters and FSDP2 local shards pass;
    temporaries do not, even when allocated where the last sync's was freed; nor does a
    buffer the export refills for every name, nor tied weights, which stay merely staged).

    A tensor whose bytes overlap those of a tensor this sync already treated as lasting,
    under another name, means the export rewrote bytes a reader may still read: that is
    an :class:`~weightsync.core.errors.IntegrityError` (the sync must fail; after
    :meth:`reset` the next one trusts nothing from before). Marked tensors are exempt: two
    names of one parameter (tied weights) are the same bytes.

    Unmarked tensors of fewer than ``min_bytes`` bytes are never lasting (copying them is
    cheaper than keeping track); they are still checked against the lasting ones.

    Lifecycle: :meth:`begin` · :meth:`lasting` per tensor · :meth:`finish` (the sync went
    through) or :meth:`reset` (it failed).
    """

    def __init__(self, *, min_bytes: int = 0) -> None:
        if not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
        self._min_bytes = min_bytes
        self._last: dict[str, tuple[tuple, Any]] = {}
        self._shared_last: set[str] = set()
        self.begin()

    def begin(self) -> None:
        self._now: dict[str, tuple[tuple, Any]] = {}
        self._shared: set[str] = set()
        self._marked: set[str] = set()
        # disjoint byte spans of this sync's tensors: start -> [end, names, lasting names]
        self._starts: list[int] = []
        self._spans: dict[int, list] = {}

    @property
    def watching(self) -> bool:
        """Whether this sync has seen a tensor of ``min_bytes`` or more (or a marked one):
        before that, a smaller tensor can overlap nothing that may last."""
        return bool(self._starts)

    def lasting(self, name: str, t: torch.Tensor, *, marked: Optional[bool] = None,
                phase: str = "send", version: Any = None) -> bool:
        """Whether ``t``'s bytes (contiguous) may be read after the iterator moves past
        it. ``marked``: whether the export marked it (default: :func:`is_stable` of ``t``;
        pass it for the local part of a marked DTensor)."""
        nbytes = t.numel() * t.element_size()
        marked = is_stable(t) if marked is None else marked
        start = t.data_ptr()
        end = start + nbytes
        if nbytes < self._min_bytes and not marked:
            if self._starts:               # only look: a small one is copied, never kept
                i, j = self._overlapping(start, end)
                for s in self._starts[i:j]:
                    span = self._spans[s]
                    self._refuse(name, span[2], False, phase, version)
                    self._shared |= span[1] - {name}
            return False
        merged = self._take_overlapping(start, end) if nbytes else []
        names = set().union(*(m[1] for m in merged)) - {name} if merged else set()
        lasting_others = set().union(*(m[2] for m in merged)) - {name} if merged else set()
        self._refuse(name, lasting_others, marked, phase, version)
        if names:
            self._shared |= names | {name}
        ok = marked
        if marked:
            self._marked.add(name)
        else:
            ref = StorageWeakRef(t.untyped_storage())
            key = (start, nbytes, ref.cdata)
            self._now[name] = (key, ref)
            last = self._last.get(name)
            ok = not names and last is not None and last[0] == key \
                and not last[1].expired() and name not in self._shared_last
        if nbytes:
            span = [max([end] + [m[0] for m in merged]), names | {name},
                    lasting_others | ({name} if ok else set())]
            first = min([start] + [m[3] for m in merged])
            bisect.insort(self._starts, first)
            self._spans[first] = span
        return ok

    def _refuse(self, name: str, lasting: set, marked: bool, phase: str,
                version: Any) -> None:
        """Raise if ``name`` lies over bytes of another name kept lasting this sync."""
        lasting = lasting - {name}
        if lasting and not (marked and lasting <= self._marked):
            other = sorted(lasting)[0]
            raise IntegrityError(
                f"{name!r} was yielded over the bytes of {other!r}, which this sync reads "
                f"after the iterator moved on: the export rewrote them within the sync "
                f"(a buffer reused for several names must be so in every sync, and "
                f"mark_stable is for parameters only)", phase=phase, version=version)

    def _overlapping(self, start: int, end: int) -> tuple[int, int]:
        """The index range in ``_starts`` of the spans overlapping ``[start, end)``."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0 or self._spans[self._starts[i]][0] <= start:
            i += 1
        j = i
        while j < len(self._starts) and self._starts[j] < end:
            j += 1
        return i, j

    def _take_overlapping(self, start: int, end: int) -> list[list]:
        """Remove and return the spans overlapping ``[start, end)`` (each with its start)."""
        i, j = self._overlapping(start, end)
        if i == j:
            return []
        out = []
        for s in self._starts[i:j]:
            span = self._spans.pop(s)
            out.append(span + [s])
        del self._starts[i:j]
        return out

    def finish(self) -> None:
        self._last, self._shared_last = self._now, set(self._shared)
        self.begin()

    def reset(self) -> None:
        self._last, self._shared_last = {}, set()
        self.begin()


def view_record(name: str, t: torch.Tensor) -> tuple:
    """What :func:`same_view` compares a later tensor against: ``t`` under ``name``."""
    return (name, t.data_ptr(), t.shape, t.dtype, StorageWeakRef(t.untyped_storage()),
            weakref.ref(t))


def same_view(rec: tuple, name: str, t: torch.Tensor) -> bool:
    """Whether ``t`` under ``name`` is the tensor of ``rec`` (:func:`view_record`) again:
    the same name, address, shape and dtype, over the same storage, still alive (the very
    object, checked first as the cheaper test, or a new view of it)."""
    if rec[0] != name or rec[1] != t.data_ptr() or rec[2] != t.shape or rec[3] is not t.dtype:
        return False
    return rec[5]() is t or (not rec[4].expired()
                             and rec[4].cdata == t.untyped_storage()._cdata)


class ReplayedLasting:
    """:class:`LastingStorage` for a weight set yielded the same way every sync, at the
    cost of a comparison per tensor.

    Once two syncs in a row yielded the same sequence (position by position the same
    name, over the same bytes of the same storage, still alive, with the same shape and
    dtype), a third that yields it again gets the tracker's answers of the last one: the
    tracker would compute exactly those. The first tensor that differs hands the sequence
    so far to the tracker, which answers from there on as it would have from the start
    (an export that begins rewriting a kept buffer is still an
    :class:`~weightsync.core.errors.IntegrityError`).

    Lifecycle as :class:`LastingStorage`: :meth:`begin` · :meth:`lasting` per tensor ·
    :meth:`finish` or :meth:`reset`. ``replayed``: answers of this sync taken over.
    """

    def __init__(self, tracker: Optional[LastingStorage] = None) -> None:
        self.tracker = tracker if tracker is not None else LastingStorage(min_bytes=0)
        self._prev: list[tuple] = []
        self._prev_steady = False    # the last sync's answers repeat for its sequence
        self.begin()

    def begin(self) -> None:
        self.tracker.begin()
        self._now: list[tuple] = []
        self._seen: list[tuple[str, torch.Tensor]] = []
        self._same = bool(self._prev)              # the sequence so far is the last one
        self._replaying = self._same and self._prev_steady
        self.replayed = 0

    def lasting(self, name: str, t: torch.Tensor, *, version: Any = None) -> bool:
        pos = len(self._now)
        if self._same:
            prev = self._prev[pos] if pos < len(self._prev) else None
            self._same = prev is not None and same_view(prev[0], name, t)
            if self._same and self._replaying:
                self._now.append(prev)
                self._seen.append((name, t))
                self.replayed += 1
                return prev[1]
            if self._same:                         # tracked, and kept to compare next time
                ok = self.tracker.lasting(name, t, version=version)
                self._now.append((prev[0], ok))
                return ok
        if self._replaying:
            self._leave_replay(version)
        ok = self.tracker.lasting(name, t, version=version)
        self._now.append((view_record(name, t), ok))
        return ok

    def _leave_replay(self, version: Any) -> None:
        """The sequence departs from the last sync's: the tracker sees all of it."""
        self._replaying = False
        seen, self._seen = self._seen, []
        for name, t in seen:
            self.tracker.lasting(name, t, version=version)

    def finish(self) -> None:
        same = self._same and len(self._now) == len(self._prev)
        if self._replaying and same:
            self.tracker.begin()        # the very sequence the tracker knows: keep it
        else:
            if self._replaying:
                self._leave_replay(None)
            self.tracker.finish()
        self._prev, self._prev_steady, self._seen = self._now, same, []
        self.begin()

    def reset(self) -> None:
        self.tracker.reset()
        self._prev, self._prev_steady = [], False
        self.begin()
