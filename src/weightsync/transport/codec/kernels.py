"""The element-level work of the delta codec on the host (numpy, no torch thread pool), and
the change digest both sides compute.

Every function takes contiguous tensors viewed as same-width integers
(:func:`int_view`): an element "changed" when its bits changed. Positions are int64
tensors, sorted. The heavy passes run through numpy on zero-copy views: the word
comparison in cache-sized chunks into one reused mask (no fresh pages per tensor), fancy
indexing: faster than torch's CPU kernels for these on one thread, and they do not
contend for torch's thread pool with a training step. The same work on a GPU is
:mod:`.gpu` (device kernels, no host work per change).

The change digest (:func:`change_digest`) is the sum over a record's entries of
``h(p, new) - h(p, old)`` mod 2**64, ``h`` a multiply-xorshift of the position ``p`` and
the element's bits (zero-extended to 64 bits): :mod:`.gpu` computes the very same value with
tensor operations, so a record made on one device is checked on the other.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

__all__ = ["int_view", "uint_bits", "changed", "gather", "put", "change_digest", "hash_np",
           "K1", "K2", "K3"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}
_NP_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_CHUNK_WORDS = 1 << 17
_scratch = threading.local()
#: Odd 64-bit multipliers of the change digest's hash (below 2**63: plain int64 literals in
#: device code too).
K1, K2, K3 = 0x1F3D5B79A3C5E7F1, 0x2545F4914F6CDD1D, 0x4CF5AD432745937F


def int_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's elements as integers of the same width: ``(n,)``, or ``(n, 2)``
    int64 for 16-byte elements (complex128)."""
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    size = flat.element_size()
    out = flat.view(_INT_OF_SIZE[size])
    return out.view(-1, 2) if size == 16 else out


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def uint_bits(values: np.ndarray) -> np.ndarray:
    """Each element's bits as a uint64 (zero-extended; 1, 2, 4 or 8-byte elements)."""
    size = values.dtype.itemsize
    return values.view(_NP_OF_SIZE[size]).astype(np.uint64)


def changed(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Positions (int64, sorted) of the elements of ``new`` whose bits differ from ``base``
    (host tensors; device tensors: compared with torch, for tests)."""
    nv, bv = int_view(new), int_view(base)
    if new.device.type != "cpu":
        ne = nv != bv
        return (ne.any(dim=1) if ne.dim() == 2 else ne).nonzero().view(-1)
    k, n = new.element_size(), new.numel()
    nb, bb = new.reshape(-1).view(torch.uint8), base.reshape(-1).view(torch.uint8)
    words = (n * k) // 8
    if k >= 8 or words == 0 or nb.storage_offset() % 8 or bb.storage_offset() % 8:
        a, b = _np(nv), _np(bv)
        ne = a != b
        return _positions(np.flatnonzero(ne.any(axis=1) if ne.ndim == 2 else ne))
    per = 8 // k
    a = _np(nb[: words * 8]).view(np.uint64)
    b = _np(bb[: words * 8]).view(np.uint64)
    w = _changed_words(a, b)
    lanes = (a[w] ^ b[w]).view(_NP_OF_SIZE[k])         # element j of word i at i*per + j
    q = np.flatnonzero(lanes)
    idx = w[q // per] * per + q % per
    if words * per < n:                                 # elements past the last word
        tail = np.arange(words * per, n)
        hit = tail[_np(nv)[tail] != _np(bv)[tail]]
        idx = np.concatenate([idx, hit]) if hit.size else idx
    return _positions(idx)


def _positions(idx: np.ndarray) -> torch.Tensor:
    if idx.size == 0:
        return torch.empty(0, dtype=torch.int64)
    return torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64))


def _changed_words(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    mask = getattr(_scratch, "mask", None)
    if mask is None:
        mask = _scratch.mask = np.empty(_CHUNK_WORDS, dtype=np.bool_)
    found = []
    for start in range(0, a.size, _CHUNK_WORDS):
        end = min(a.size, start + _CHUNK_WORDS)
        hits = np.flatnonzero(np.not_equal(a[start:end], b[start:end], out=mask[: end - start]))
        if hits.size:
            found.append(hits + start)
    if not found:
        return np.empty(0, dtype=np.int64)
    return np.concatenate(found) if len(found) > 1 else found[0]


def gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` at ``idx`` (integer view)."""
    v = int_view(t)
    if idx.numel() == 0:
        return torch.empty((0, *v.shape[1:]), dtype=v.dtype, device=t.device)
    if t.device.type == "cpu":
        return torch.from_numpy(np.ascontiguousarray(_np(v)[_np(idx)]))
    return v[idx.to(t.device, torch.int64)]


def put(t: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` (integer view) at ``idx`` of ``t``, in place."""
    v = int_view(t)
    if idx.numel() == 0:
        return
    if t.device.type == "cpu":
        _np(v)[_np(idx)] = _np(values.view(v.dtype).view(-1, *v.shape[1:]))
        return
    v[idx.to(t.device, torch.int64)] = values.view(v.dtype).view(-1, *v.shape[1:])


def hash_np(pos: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """``h(p, e)`` of each entry (uint64): ``x = e ^ p*K2; x *= K1; x ^= x >> 29; x *= K3;
    x ^= x >> 32`` in wrapping 64-bit arithmetic."""
    with np.errstate(over="ignore"):
        x = bits ^ (pos.astype(np.int64).view(np.uint64) * np.uint64(K2))
        x = x * np.uint64(K1)
        x ^= x >> np.uint64(29)
        x = x * np.uint64(K3)
        x ^= x >> np.uint64(32)
    return x


def change_digest(idx: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> int:
    """The 64-bit digest of a change set: the sum over positions ``idx`` of ``h(i, new) -
    h(i, old)`` (mod 2**64; ``old`` / ``new`` the elements' integer views at ``idx``). The
    sender computes it from its base and the new values; the receiver from the values it
    holds at those positions and the record's, before it writes anything, so a wrong
    position, value or base element shows. O(changes), on the host."""
    if idx.numel() == 0:
        return 0
    pos = _np(idx.cpu()).astype(np.int64)
    with np.errstate(over="ignore"):
        total = hash_np(pos, uint_bits(_np(new.cpu()).reshape(-1))).sum(dtype=np.uint64) - \
            hash_np(pos, uint_bits(_np(old.cpu()).reshape(-1))).sum(dtype=np.uint64)
    return int(total)
