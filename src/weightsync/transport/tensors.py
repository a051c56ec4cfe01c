"""Small helpers shared by the engines."""

from __future__ import annotations

import zlib
from typing import Any, AsyncIterator

import torch

try:  # optional, faster
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

__all__ = ["aiter_items", "checksum", "CASTABLE", "wire_dtype", "as_bytes", "plain_cpu",
           "mark_partial", "partial_boxes", "mark_stable", "is_stable"]

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


def plain_cpu(t: torch.Tensor) -> bool:
    """A dense, contiguous CPU tensor whose bytes can be moved as they are."""
    return (t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous()
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
