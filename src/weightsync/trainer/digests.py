"""The trainer's side of the weight-set checks: what an export will yield, and its digests.

:func:`describe_export` tells, from metadata only, what ``export_weights`` yields over all
ranks (checked by each replica before any byte moves); :func:`export_digests` hashes what
the export yields, each tensor cast as the replica holds it, for ``verify()``. The hashing
itself lives in :mod:`weightsync.core.digests`. Called by the Ray trainer mixin.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from weightsync.core.digests import parse_box_key, tensor_digest
from weightsync.core.plan import dtype_from_name, dtype_name
from weightsync.trainer.export import export_weights, plan_export
from weightsync.transport.codec.fp8 import DEFAULT_SKIP, Quantizer

__all__ = ["describe_export", "export_digests"]


def describe_export(model: torch.nn.Module, kind: str = "full",
                    dtype: Optional[torch.dtype] = None) -> list[list]:
    """What ``export_weights(model, kind=kind, dtype=dtype)`` yields over all ranks, from
    metadata only: no tensor is gathered, merged or cast."""
    out = []
    for item in plan_export(model, kind):
        src = item.sources[0]
        wire = dtype if dtype is not None and src.is_floating_point() else src.dtype
        out.append([item.name, [int(d) for d in src.shape], dtype_name(wire)])
    return out


def export_digests(model: torch.nn.Module, *, kind: str = "full",
                   dtype: Optional[torch.dtype] = None, group: Any = None,
                   cast_to: Optional[dict[str, str]] = None, quantize: Optional[str] = None,
                   quantize_skip: Optional[Sequence[str]] = None) -> dict[str, str]:
    """Digests of the tensors this rank exports (every rank of the export group must call
    it: FSDP2 shards move to their owners as in a sync), each cast to ``cast_to[name]``
    first when given (the dtype the replica holds it in). ``quantize`` (an FP8 scheme of
    the codec): the tensors it quantizes are hashed as FP8 weight and scale, as the
    replica got them (the quantizer is deterministic). A key of ``cast_to`` that is a
    :func:`~weightsync.core.digests.box_key` (a replica that keeps boxes of a tensor) gets
    the digest of that box; the whole tensor is then hashed only if asked for too."""
    quantizer = None
    if quantize:
        quantizer = Quantizer(quantize, skip=DEFAULT_SKIP if quantize_skip is None
                              else tuple(quantize_skip))
    out = {}
    boxes: dict[str, list] = {}
    for key in cast_to or {}:
        parsed = parse_box_key(key)
        if parsed is not None:
            boxes.setdefault(parsed[0], []).append((key, parsed[1]))
    # as in a sync: the export (cast to ``dtype``) is what the codec quantizes
    for name, t in export_weights(model, kind=kind, dtype=dtype, group=group):
        pieces = quantizer.expand(name, t) if quantizer is not None else [(name, t)]
        for piece_name, piece in pieces:
            if piece is not t:                        # FP8 weight or scale: as held
                out[piece_name] = tensor_digest(piece)
                continue
            parts = boxes.get(piece_name, ())
            for key, box in parts:                    # what a worker that keeps boxes holds
                held = dtype_from_name(cast_to[key])
                sub = piece[tuple(slice(a, b) for a, b in box)]
                out[key] = tensor_digest((sub if sub.dtype == held else sub.to(held)).contiguous())
            if parts and piece_name not in (cast_to or {}):
                continue
            want = (cast_to or {}).get(piece_name)
            if want is not None:
                held = dtype_from_name(want)
                if piece.dtype != held:
                    piece = piece.to(held)
            out[piece_name] = tensor_digest(piece)
    return out
