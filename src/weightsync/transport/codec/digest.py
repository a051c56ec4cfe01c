"""Digests of a tensor's bytes, as the codec checks bases with them.

A digest is ``(kind, value)``: ``value`` a 64-bit int over the tensor's raw bytes (not its
dtype or shape: the record header carries those). The trainer picks the kind, the receiver
computes the same kind on whatever device it holds the tensor, so the pair compares
across devices:

* ``XXH3`` (1): xxh3-64 of the bytes (CPU; a CUDA tensor is copied to the host first).
* ``TORCH`` (2): a multiply-xorshift hash of the bytes as 64-bit words, summed with
  position weights (wrapping int64 arithmetic, the same on CPU and CUDA): what a CUDA
  trainer uses, so its tensors never leave the device to be hashed.
* ``BLAKE2`` (3): blake2b-64, where xxhash is not installed (slower).

These catch accidents (a stale or corrupted base, a bug), not an attacker who can write
the weights: like every digest in weightsync, they are not a MAC.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch

try:  # optional, faster
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

__all__ = ["XXH3", "TORCH", "BLAKE2", "KINDS", "digest", "default_kind", "flat_bytes"]

XXH3, TORCH, BLAKE2 = 1, 2, 3
KINDS = (XXH3, TORCH, BLAKE2)
_MASK = (1 << 64) - 1
_K1 = 0x1F3D5B79A3C5E7F1 >> 1      # odd multipliers that fit a signed int64
_K2 = 0x2545F4914F6CDD1D
_K3 = 0x4CF5AD432745937F
_CHUNK = 1 << 22                   # words per pass of the torch hash (bounds temporaries)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``t``'s bytes (copied only if ``t`` is not contiguous)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def default_kind(t: torch.Tensor) -> int:
    """The kind a sender uses for ``t``: device-side on CUDA, xxh3 (else blake2) on CPU."""
    if t.device.type != "cpu":
        return TORCH
    return XXH3 if _xxhash is not None else BLAKE2


def digest(t: torch.Tensor, kind: Optional[int] = None) -> tuple[int, int]:
    """``(kind, value)`` of ``t``'s bytes; ``kind`` None: :func:`default_kind`.

    ``ValueError`` for a kind this process cannot compute (xxh3 without xxhash)."""
    kind = default_kind(t) if kind is None else kind
    b = flat_bytes(t.detach())
    if kind == TORCH:
        return kind, _torch_hash(b)
    if kind not in (XXH3, BLAKE2):
        raise ValueError(f"unknown digest kind {kind!r}")
    if b.device.type != "cpu":
        b = b.cpu()
    view = memoryview(b.numpy()) if b.numel() else b""
    if kind == XXH3:
        if _xxhash is None:
            raise ValueError("xxh3 digests need the xxhash package")
        return kind, _xxhash.xxh3_64_intdigest(view)
    return kind, int.from_bytes(hashlib.blake2b(view, digest_size=8).digest(), "little")


def _words(b: torch.Tensor) -> torch.Tensor:
    """``b`` (flat uint8) as int64 words, the tail zero-padded to a whole word."""
    n = b.numel()
    if n % 8 or b.storage_offset() % 8:
        padded = torch.zeros(((n + 7) // 8) * 8, dtype=torch.uint8, device=b.device)
        padded[:n] = b
        b = padded
    return b.view(torch.int64)


def _torch_hash(b: torch.Tensor) -> int:
    words = _words(b)
    acc = torch.zeros((), dtype=torch.int64, device=b.device)
    mask = (1 << 33) - 1
    for start in range(0, words.numel(), _CHUNK):
        w = words[start: start + _CHUNK]
        pos = torch.arange(start, start + w.numel(), dtype=torch.int64, device=b.device)
        h = w * _K1 + pos * _K2
        h = h ^ ((h >> 31) & mask)        # logical shift: mask off the sign's copies
        h = h * _K3
        h = h ^ ((h >> 29) & ((1 << 35) - 1))
        acc = acc + h.sum()
    value = (int(acc.item()) ^ (b.numel() * _K2)) & _MASK
    return value
