"""Delta records: a tensor's changed elements as one self-describing ``uint8`` tensor.

The diff is bytewise per element, so it applies to every dtype (bool, fp8 and complex
included): two elements differ when their bits differ (``-0.0`` vs ``0.0``, two NaNs of
other payloads). :func:`encode` picks the smallest form:

* dense: the tensor itself (``None`` is returned; the caller sends the tensor);
* ``INDEX``: the changed positions (uint16/uint32/int64, by the tensor's size) + values;
* ``BITMAP``: one bit per element + the values of the set bits.

A record (little-endian)::

    magic "WSDELTA1" | fmt u8 | enc u8 | dtype u8 | ndim u8 | index width u8 |
    digest kind u8 | 0 u16 | count u64 | base digest u64 | change digest u64 |
    payload bytes u64 | dims u64 x ndim | section (indices or bitmap), 8-aligned | values
    | zero padding to a size class (<= 1/8 more; repeated sizes keep plans replayable)

``RAW`` records carry a dense tensor's bytes; the sender wraps a dense ``uint8`` 1-D
tensor that happens to start with the magic in one, so "1-D uint8 starting with the magic"
is a record, unambiguously.

:func:`apply` writes a record into the receiver's own tensor after checking that tensor's
full digest against the sender's base digest (:mod:`.digest`), then reads the changed
elements back and checks their :func:`change_digest` against the sender's: with the base
verified, the result is then the sender's tensor. The second check costs only the changed
elements (a full digest of the result would read the whole tensor again). A record that
does not parse is a :class:`~weightsync.core.errors.WireError`, never a wrong write.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from weightsync.core.errors import WireError
from weightsync.core.plan import dtype_from_name, dtype_name
from weightsync.transport.codec import kernels
from weightsync.transport.codec.digest import KINDS, digest

__all__ = ["MAGIC", "RAW", "INDEX", "BITMAP", "Header", "BaseMismatch", "ResultMismatch",
           "encode", "raw_record", "is_record", "parse", "apply", "dense_view", "scatter",
           "size_class", "record_sizes", "record_size", "index_width"]

MAGIC = b"WSDELTA1"
FMT = 1
RAW, INDEX, BITMAP = 0, 1, 2
_HEAD = struct.Struct("<8sBBBBBBHQQQQ")
#: Fixed codes of the dtypes a record may carry (never reordered: both sides agree).
DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
               "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "int8", "int16",
               "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool", "complex64",
               "complex128")
_INDEX_DTYPE = {2: torch.uint16, 4: torch.uint32, 8: torch.int64}
_MAX_NDIM = 16


class BaseMismatch(Exception):
    """The receiver's tensor is not the base the record was computed against."""


class ResultMismatch(Exception):
    """After applying, the tensor's digest is not the one the sender computed."""


@dataclass(frozen=True)
class Header:
    enc: int
    dtype: torch.dtype
    shape: tuple
    index_width: int
    kind: int
    count: int
    base: int
    new: int
    payload: int       # bytes of section + values
    offset: int        # where the section starts

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to the next of a few sizes per power of two (<= 12.5 % more)."""
    if nbytes <= 256:
        return 256
    step = 1 << max(0, nbytes.bit_length() - 4)
    return (nbytes + step - 1) // step * step


def index_width(n: int) -> int:
    return 2 if n <= 1 << 16 else (4 if n <= 1 << 32 else 8)


def record_sizes(n: int, itemsize: int, m: int) -> dict[int, int]:
    """Payload bytes (section + values) of each form for ``m`` changes of ``n`` elements."""
    values = m * itemsize
    return {INDEX: _pad8(m * index_width(n)) + values, BITMAP: _pad8((n + 7) // 8) + values}


def _head_bytes(ndim: int) -> int:
    return _HEAD.size + 8 * ndim


def _form(n: int, itemsize: int, m: int) -> tuple[int, int]:
    """(enc, payload bytes) of the smaller form for ``m`` changes of ``n`` elements."""
    sizes = record_sizes(n, itemsize, m)
    enc = INDEX if sizes[INDEX] <= sizes[BITMAP] else BITMAP
    return enc, sizes[enc]


def record_size(shape: Sequence[int], itemsize: int, changed: int) -> Optional[int]:
    """Bytes of the record :func:`encode` makes when ``changed`` elements of a tensor of
    ``shape`` (elements of ``itemsize`` bytes) differ from its base, size class included;
    None when the dense tensor is no bigger (:func:`encode` then sends the tensor)."""
    n = math.prod(shape)
    size = size_class(_head_bytes(len(shape)) + _form(n, itemsize, changed)[1])
    return None if size >= n * itemsize else size


def _new_record(enc: int, t: torch.Tensor, *, iw: int, kind: int, count: int, base: int,
                new: int, payload: int) -> tuple[torch.Tensor, int]:
    head = _head_bytes(t.dim())
    rec = torch.zeros(size_class(head + payload), dtype=torch.uint8, device=t.device)
    packed = _HEAD.pack(MAGIC, FMT, enc, DTYPE_NAMES.index(dtype_name(t.dtype)), t.dim(), iw,
                        kind, 0, count, base, new, payload)
    packed += struct.pack(f"<{t.dim()}Q", *t.shape)
    rec[:head] = torch.frombuffer(bytearray(packed), dtype=torch.uint8).to(t.device)
    return rec, head


def encode(new: torch.Tensor, base: torch.Tensor, base_digest: tuple[int, int]
           ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """``(record, changed)``: ``record`` None when dense is no bigger (send ``new``);
    ``changed`` the sorted positions of the changed elements (for :func:`scatter`).
    ``new`` and ``base``: contiguous, same dtype, shape and device; ``base_digest``: the
    digest of ``base`` as the receiver will check it."""
    n, k = new.numel(), new.element_size()
    idx = kernels.changed(new, base)
    m = idx.numel()
    if record_size(tuple(new.shape), k, m) is None:
        return None, idx
    enc, payload = _form(n, k, m)
    values = kernels.gather(new, idx)
    iw = index_width(n) if enc == INDEX else 0
    rec, at = _new_record(enc, new, iw=iw, kind=base_digest[0], count=m, base=base_digest[1],
                          new=kernels.change_digest(idx, kernels.gather(base, idx), values),
                          payload=payload)
    if enc == INDEX:
        section = idx.to(_INDEX_DTYPE[iw]).view(torch.uint8)
    else:
        section = kernels.pack_bits(idx, n, new.device)
    rec[at: at + section.numel()] = section.to(rec.device)
    at += _pad8(section.numel())
    rec[at: at + m * k] = values.reshape(-1).view(torch.uint8).to(rec.device)
    return rec, idx


def raw_record(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's bytes in a record (for a tensor that looks like a record)."""
    t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    rec, at = _new_record(RAW, t, iw=0, kind=KINDS[0], count=t.numel(), base=0, new=0,
                          payload=nbytes)
    rec[at: at + nbytes] = t.reshape(-1).view(torch.uint8)
    return rec


def is_record(t: torch.Tensor) -> bool:
    if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() < _HEAD.size:
        return False
    return bytes(t[:8].cpu().tolist()) == MAGIC


def scatter(base: torch.Tensor, new: torch.Tensor, idx: torch.Tensor) -> None:
    """Make ``base`` equal ``new`` by writing only the changed elements (``idx``), or all
    of them where that many changed."""
    if idx.numel() == 0:
        return
    if idx.numel() * 8 > new.numel():
        base.copy_(new)
        return
    kernels.put(base, idx, kernels.gather(new, idx))


def _bad(why: str) -> WireError:
    return WireError(f"malformed delta record: {why}", phase="receive")


def parse(rec: torch.Tensor) -> Header:
    """The header of a record; ``WireError`` for anything inconsistent."""
    if not is_record(rec):
        raise _bad("no magic")
    raw = bytes(rec[:_HEAD.size].cpu().tolist())
    (_, fmt, enc, code, ndim, iw, kind, _, count, base, new, payload) = _HEAD.unpack(raw)
    if fmt != FMT or enc not in (RAW, INDEX, BITMAP) or code >= len(DTYPE_NAMES) \
            or ndim > _MAX_NDIM or kind not in KINDS:
        raise _bad(f"fmt={fmt} enc={enc} dtype={code} ndim={ndim} kind={kind}")
    offset = _head_bytes(ndim)
    if rec.numel() < offset:
        raise _bad("truncated shape")
    shape = struct.unpack(f"<{ndim}Q", bytes(rec[_HEAD.size: offset].cpu().tolist()))
    try:
        dtype = dtype_from_name(DTYPE_NAMES[code])
    except ValueError:
        raise _bad(f"dtype {DTYPE_NAMES[code]} unavailable here") from None
    head = Header(enc, dtype, tuple(int(d) for d in shape), iw, kind, count, base, new,
                  payload, offset)
    n, k = head.numel, dtype.itemsize
    if enc == RAW:
        want = n * k
    elif count > n or (enc == INDEX and iw != index_width(n)) or (enc == BITMAP and iw):
        raise _bad(f"count {count} of {n} elements, index width {iw}")
    else:
        want = record_sizes(n, k, count)[enc]
    if payload != want or rec.numel() < offset + payload:
        raise _bad(f"payload {payload} bytes, want {want}, record has {rec.numel() - offset}")
    return head


def _typed(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    try:
        return buf.view(dtype)
    except RuntimeError:  # misaligned view into someone's buffer: copy it
        return buf.clone().view(dtype)


def dense_view(head: Header, rec: torch.Tensor) -> torch.Tensor:
    """The tensor a ``RAW`` record carries (a view into ``rec`` where aligned)."""
    body = rec[head.offset: head.offset + head.payload]
    if head.dtype == torch.bool:
        return _typed(body, torch.uint8).view(torch.bool).view(head.shape)
    return _typed(body, head.dtype).view(head.shape)


def apply(head: Header, rec: torch.Tensor, dest: torch.Tensor) -> None:
    """Write a delta record into ``dest`` (its base): ``BaseMismatch`` if the digest of
    ``dest`` is not the base's (nothing written); ``ResultMismatch`` if the change read back
    from ``dest`` after writing is not the sender's (its :func:`change_digest`)."""
    if head.enc == RAW:
        raise ValueError("a RAW record is dense: use dense_view")
    if dest.dtype != head.dtype or tuple(dest.shape) != head.shape or not dest.is_contiguous():
        raise BaseMismatch(f"holds {dest.dtype} {tuple(dest.shape)}, the record is for "
                           f"{head.dtype} {head.shape}")
    if digest(dest, head.kind)[1] != head.base:
        raise BaseMismatch("base digest differs")
    body = rec[head.offset: head.offset + head.payload].to(dest.device)
    n, k, m = head.numel, head.dtype.itemsize, head.count
    if head.enc == INDEX:
        idx = _typed(body[: m * head.index_width], _INDEX_DTYPE[head.index_width]).to(torch.int64)
        if m and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise _bad("index out of range")
        at = _pad8(m * head.index_width)
    else:
        idx = kernels.unpack_bits(body[: (n + 7) // 8], n)
        if idx.numel() != m:
            raise _bad("bitmap count differs from the header's")
        at = _pad8((n + 7) // 8)
    values = _typed(body[at: at + m * k], kernels.int_view(dest).dtype)
    old = kernels.gather(dest, idx)
    kernels.put(dest, idx, values)
    if kernels.change_digest(idx, old, kernels.gather(dest, idx)) != head.new:
        raise ResultMismatch("the change applied differs from the sender's (digest)")
