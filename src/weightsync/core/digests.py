"""Weight-set checks before bytes move, and weight digests after they moved.

*Before a sync* the trainer describes what it is about to send without moving any bytes
(:func:`weightsync.trainer.digests.describe_export`: ``[name, shape, dtype]`` per tensor, from the model's metadata,
FSDP2 shards described by their full shape), and each rollout replica checks that
description against its model (:func:`check_weight_set`): a name the model does not have,
a tensor of another shape, a dtype that cannot be cast into the model's (floating into
integer, say), or, for a weight set that must cover the model, a tensor left out.

*After a sync* :func:`tensor_digest` hashes one tensor (xxh3-64 of dtype, shape and
bytes); a receiver that keeps only boxes of a tensor (a tensor-parallel worker) hashes
each box under :func:`box_key` (``name[a:b,c:d]``), which the trainer side hashes too;
:func:`combine_digests` folds ``{name: digest}`` into one value, in name order.
The trainer side (:func:`weightsync.trainer.digests.export_digests`) hashes what the export yields, each tensor cast
to the dtype the replica holds it in, exactly as the replica's ``copy_`` casts it, so a
replica that received every byte correctly has the same digests, whatever the sharding
or the wire dtype.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable

import torch

from weightsync.core.plan import dtype_from_name, dtype_name

try:  # optional, faster
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

__all__ = ["describe_tensors", "check_weight_set", "tensor_digest", "combine_digests",
           "compare_digests", "box_key", "parse_box_key", "MAX_LISTED"]

#: How many offending names an error message lists (all are kept on the exception).
MAX_LISTED = 20


def describe_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[list]:
    """``[[name, [dims], dtype name], ...]`` (JSON-able) of ``(name, tensor)`` pairs."""
    return [[n, [int(d) for d in t.shape], dtype_name(t.dtype)] for n, t in named]


def _castable(sent: str, held: torch.dtype) -> bool:
    try:
        src = dtype_from_name(sent)
    except Exception:
        return False
    return src == held or (src.is_floating_point and held.is_floating_point)


def check_weight_set(targets: dict[str, torch.Tensor], offered: Any, *,
                     complete: bool) -> list[list[str]]:
    """Problems of applying ``offered`` (``[[name, shape, dtype], ...]``) to ``targets``
    (the model's tensors by name; tied names may share a tensor): ``[name, why]`` per
    offending tensor, empty when it fits. ``complete``: every target must be covered."""
    if not isinstance(offered, (list, tuple)):
        raise ValueError(f"offered must be a list of [name, shape, dtype], got {offered!r}")
    problems, covered = [], set()
    for entry in offered:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3):
            raise ValueError(f"bad weight description {entry!r}: want [name, shape, dtype]")
        name, shape, dtype = entry
        dst = targets.get(name)
        if dst is None:
            problems.append([name, "sent, but the model has no such tensor"])
            continue
        covered.add(id(dst))
        if tuple(shape) != tuple(dst.shape):
            problems.append([name, f"shape {tuple(shape)} sent, the model has "
                                   f"{tuple(dst.shape)}"])
        elif not _castable(dtype, dst.dtype):
            problems.append([name, f"dtype {dtype} sent, the model holds "
                                   f"{dtype_name(dst.dtype)}"])
    if complete:
        seen = set()
        for name, t in targets.items():
            if id(t) not in covered and id(t) not in seen:
                seen.add(id(t))
                problems.append([name, "the model has it, the sync would not send it"])
    return problems


def tensor_digest(t: torch.Tensor) -> str:
    """16 hex digits: xxh3-64 of dtype, shape and bytes (blake2b without xxhash)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    raw = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    head = f"{dtype_name(t.dtype)}{list(t.shape)}".encode()
    if _xxhash is not None:
        h = _xxhash.xxh3_64(head)
        h.update(raw)
        return h.hexdigest()
    h2 = hashlib.blake2b(head, digest_size=8)
    h2.update(raw)
    return h2.hexdigest()


def combine_digests(digests: dict[str, str]) -> str:
    """One digest of ``{name: digest}``, independent of the dict's order."""
    lines = "".join(f"{n}={d}\n" for n, d in sorted(digests.items())).encode()
    if _xxhash is not None:
        return _xxhash.xxh3_64_hexdigest(lines)
    return hashlib.blake2b(lines, digest_size=8).hexdigest()


def compare_digests(expected: dict[str, str], got: dict[str, str]) -> list[str]:
    """Names whose digest differs, is missing from ``got`` or is not in ``expected``."""
    bad = [n for n, d in expected.items() if got.get(n) != d]
    bad += [n for n in got if n not in expected]
    return sorted(bad)


def box_key(name: str, box: Iterable[tuple[int, int]]) -> str:
    """The digest key of box ``box`` (a ``(start, stop)`` per dimension) of ``name``."""
    return f"{name}[{','.join(f'{int(a)}:{int(b)}' for a, b in box)}]"


def parse_box_key(key: str) -> tuple[str, tuple[tuple[int, int], ...]] | None:
    """``(name, box)`` of a :func:`box_key`, None for a plain name."""
    if not key.endswith("]") or "[" not in key:
        return None
    name, _, body = key[:-1].rpartition("[")
    try:
        box = tuple((int(a), int(b)) for a, b in (p.split(":") for p in body.split(",")))
    except ValueError:
        return None
    return (name, box) if name else None
