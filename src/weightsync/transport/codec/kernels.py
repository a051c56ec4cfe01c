"""The element-level work of the delta codec, on CPU (numpy, no torch thread pool) or on
the tensors' device (torch).

Every function takes contiguous tensors viewed as same-width integers
(:func:`int_view`): an element "changed" when its bits changed. Positions are int64
tensors, sorted. On CPU the heavy passes run through numpy on zero-copy views: the word
comparison in cache-sized chunks into one reused mask (no fresh pages per tensor), fancy
indexing, ``packbits``; measured 2-10 x faster than torch's CPU kernels for these on one
thread, and they do not contend for torch's thread pool with a training step.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

__all__ = ["int_view", "changed", "gather", "put", "pack_bits", "unpack_bits",
           "change_digest"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}
_NP_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_CHUNK_WORDS = 1 << 17
_scratch = threading.local()
_K1, _K2, _K3 = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F),
                 np.uint64(0x165667B19E3779F9))


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


def changed(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Positions (int64, sorted) of the elements of ``new`` whose bits differ from ``base``."""
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
    return v[idx]


def put(t: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` (integer view) at ``idx`` of ``t``, in place."""
    v = int_view(t)
    if idx.numel() == 0:
        return
    if t.device.type == "cpu":
        _np(v)[_np(idx)] = _np(values.view(v.dtype).view(-1, *v.shape[1:]))
        return
    v[idx] = values.view(v.dtype).view(-1, *v.shape[1:])


def pack_bits(idx: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """One bit per element (little-endian within a byte), set at ``idx``."""
    if torch.device(device).type == "cpu":
        mask = np.zeros(n, dtype=np.bool_)
        mask[_np(idx)] = True
        return torch.from_numpy(np.packbits(mask, bitorder="little"))
    mask = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=device)
    mask[idx] = 1
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)
    return (mask.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """The positions of the set bits among the first ``n``."""
    if bits.device.type == "cpu":
        flat = np.unpackbits(_np(bits), count=n, bitorder="little")
        return _positions(np.flatnonzero(flat))
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits.unsqueeze(1) >> shifts) & 1).reshape(-1)[:n].nonzero().view(-1)


def _lanes(values: torch.Tensor) -> np.ndarray:
    """Each element's bits as one uint64 (16-byte elements: their two words mixed)."""
    v = _np(values.cpu())
    if v.ndim == 2:
        return v[:, 0].view(np.uint64) * _K3 + v[:, 1].view(np.uint64)
    return v.astype(np.int64).view(np.uint64)


def change_digest(idx: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> int:
    """A 64-bit digest of a change set: the sum over changed positions of h(i, new) minus
    h(i, old) (mod 2**64), ``h`` a multiply-xorshift of the position and the element's
    bits. The sender computes it from its values, the receiver from what it read before
    writing and reads back after, so a wrong position or value shows. O(changes), on CPU."""
    if idx.numel() == 0:
        return 0
    with np.errstate(over="ignore"):
        pos = _np(idx.cpu()).astype(np.uint64) * _K2

        def h(u: np.ndarray) -> np.ndarray:
            x = (u ^ pos) * _K1
            x ^= x >> np.uint64(29)
            return x * _K3
        total = h(_lanes(new)).sum(dtype=np.uint64) - h(_lanes(old)).sum(dtype=np.uint64)
    return int(total)
