"""FP8 on the fly: the trainer's weights quantized to float8_e4m3fn while they stream out.

Two schemes, as rollout checkpoints lay them out:

* ``"fp8-block"`` (DeepSeek-V3 / Kimi-K2): a 2-D ``...weight`` of shape ``(M, N)`` becomes
  ``...weight`` in float8_e4m3fn ``(M, N)`` plus ``...weight_scale_inv`` float32
  ``(ceil(M/128), ceil(N/128))``, one scale per 128 x 128 block (edge blocks partial);
* ``"fp8-tensor"``: ``...weight`` in float8_e4m3fn plus ``...weight_scale`` float32, 0-d.

For each block (or tensor): ``amax = max |x|`` in float32, ``s = amax / 448`` (1 where
``amax`` is 0), ``q = fp8(clamp(x / s, -448, 448))``; dequantized ``q * s``, so the scale is
the dequantization multiplier (DeepSeek calls it ``weight_scale_inv``). The round-trip
error of every element is at most ``max(|x| / 16, s / 1024)`` (3 mantissa bits; the
subnormal step), up to float32 rounding.

Which tensors: 2-D floating tensors whose name ends with ``weight`` and contains none of
``skip`` (default: embeddings, norms, ``lm_head``, which FP8 checkpoints keep in bf16).
Other tensors pass unchanged (the optional ``dtype`` cast applies to them).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from weightsync.core.plan import dtype_from_name

__all__ = ["FP8", "FP8_MAX", "BLOCK", "SCHEMES", "DEFAULT_SKIP", "Quantizer", "scale_name",
           "quantize_block", "dequantize_block", "quantize_tensor", "dequantize_tensor"]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
SCHEMES = ("fp8-block", "fp8-tensor")
DEFAULT_SKIP = ("embed", "norm", "lm_head")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_BAND_BYTES = {"cpu": 16 << 20, "cuda": 1 << 30}    # float32 working set per pass


def scale_name(name: str, scheme: str) -> str:
    return name + ("_scale_inv" if scheme == "fp8-block" else "_scale")


def _scales(amax: torch.Tensor) -> torch.Tensor:
    # tensor / tensor: true division on every device (CUDA turns ``tensor / scalar`` into a
    # multiplication by the reciprocal, off by an ulp from the CPU)
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))


def quantize_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)``: ``q`` float8_e4m3fn of ``w``'s shape, ``s`` float32 ``(ceil(M/block),
    ceil(N/block))``. Works in bands of block rows (a small float32 working set), four
    passes over each band: to float32, min/max, divide in place, convert into ``q``. No
    clamp is needed: ``|x / s| <= 448`` up to one rounding, which converts to 448."""
    if w.dim() != 2:
        raise ValueError(f"block quantization needs a 2-D tensor, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    mb, nb = math.ceil(rows / block), math.ceil(cols / block)
    q = torch.empty((rows, cols), dtype=FP8, device=w.device)
    s = torch.empty((mb, nb), dtype=torch.float32, device=w.device)
    band_bytes = _BAND_BYTES.get(w.device.type, 16 << 20)
    per_pass = max(1, band_bytes // max(1, block * nb * block * 4))
    for i0 in range(0, mb, per_pass):
        i1 = min(mb, i0 + per_pass)
        r0, r1 = i0 * block, min(rows, i1 * block)
        band = w[r0:r1].to(torch.float32, copy=True)      # divided in place below
        pad_r, pad_c = (i1 - i0) * block - (r1 - r0), nb * block - cols
        if pad_r or pad_c:          # zeros change no block's amax
            band = torch.nn.functional.pad(band, (0, pad_c, 0, pad_r))
        blocks = band.view(i1 - i0, block, nb, block)
        lo, hi = torch.aminmax(blocks, dim=3)
        sc = _scales(torch.maximum(hi, lo.neg_()).amax(dim=1))        # (bands, nb)
        blocks.div_(sc[:, None, :, None])
        q[r0:r1].copy_(band[: r1 - r0, :cols])
        s[i0:i1] = sc
    return q, s


def dequantize_block(q: torch.Tensor, s: torch.Tensor, block: int = BLOCK,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    rows, cols = q.shape
    full = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (q.to(torch.float32) * full).to(dtype)


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)`` with one float32 scale (0-d) for the whole tensor."""
    x = w.to(torch.float32)
    s = _scales(x.abs().amax() if x.numel() else torch.zeros((), device=w.device))
    return (x / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8), s.to(torch.float32)


def dequantize_tensor(q: torch.Tensor, s: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * s).to(dtype)


class Quantizer:
    """Turns ``(name, tensor)`` into the FP8 layout of ``scheme`` (see the module doc)."""

    def __init__(self, scheme: str, *, skip: Sequence[str] = DEFAULT_SKIP,
                 block: int = BLOCK) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"quantize must be one of {SCHEMES} or None, got {scheme!r}")
        self.scheme, self.skip, self.block = scheme, tuple(skip), block

    def wants(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> bool:
        return (len(shape) == 2 and dtype in _FLOATS and name.endswith("weight")
                and math.prod(shape) > 0 and not any(s in name for s in self.skip))

    def expand(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``[(name, t)]`` unchanged, or ``[(name, q), (scale name, s)]``."""
        if not self.wants(name, t.shape, t.dtype):
            return [(name, t)]
        if self.scheme == "fp8-block":
            q, s = quantize_block(t, self.block)
        else:
            q, s = quantize_tensor(t)
        return [(name, q), (scale_name(name, self.scheme), s)]

    def describe(self, entries: Iterable[Sequence]) -> list[list]:
        """``[[name, shape, dtype name], ...]`` as the receiver will get them (the
        description the manager checks against the rollout model before bytes)."""
        out = []
        for name, shape, dtype in entries:
            if not self.wants(name, shape, dtype_from_name(dtype)):
                out.append([name, list(shape), dtype])
                continue
            out.append([name, list(shape), "float8_e4m3fn"])
            if self.scheme == "fp8-block":
                scale = [math.ceil(shape[0] / self.block), math.ceil(shape[1] / self.block)]
            else:
                scale = []
            out.append([scale_name(name, self.scheme), scale, "float32"])
        return out
