"""Delta records: a tensor's changed elements as one self-describing ``uint8`` tensor.

The diff is bitwise per element, so it applies to every dtype of 1, 2, 4 or 8 bytes (bool,
fp8 and complex64 included): two elements differ when their bits differ (``-0.0`` vs
``0.0``, two NaNs of other payloads). A record lists the changed positions and their new
values; a tensor with more than :func:`max_changes` changed elements (an eighth) goes
dense, as does a 1-D ``uint8`` tensor (it could be taken for a record) and one of 16-byte
elements. A record (little-endian, 64-byte header)::

    magic "WSDELTA2" | fmt u8 | enc u8 | dtype u8 | index width u8 | 0 u32 |
    numel u64 | count u64 | entries u64 | change digest u64 | 0 u64 | 0 u64 |
    positions (int32, or int64 past 2**31 elements) x entries | values x entries

``entries`` is ``count`` rounded up (:func:`entries_for`: a multiple of 8, at most 1/8
more, so repeated sizes keep the transports' plans replayable); entries past ``count`` are
zero and never read. The record's length is then ``64 + entries * (index width + element
size)``: a receiver that knows the tensor a record is for knows where its sections lie
without reading the header on the host (:mod:`.gpu` reads it on the device). The change
digest (:func:`~.kernels.change_digest`) covers the positions, the new values and the
values they replace, so a receiver checks a record against the tensor it holds before it
writes a byte: a corrupted or truncated record, or a base that differs where it changes,
is refused with the tensor untouched.

``RAW`` records carry a dense 1-D ``uint8`` tensor that starts with the magic (the sender
wraps it, so "1-D uint8 starting with the magic" is a record, unambiguously).

:func:`encode` and :func:`apply` work on host tensors (numpy; a device tensor is copied to
the host); the codec's syncs diff and apply device tensors with :mod:`.gpu`'s kernels, many
per launch, and make the same records. A record
that does not parse is a :class:`~weightsync.core.errors.WireError`, never a wrong write.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from weightsync.core.errors import WireError
from weightsync.core.plan import dtype_from_name, dtype_name
from weightsync.transport.codec import kernels

__all__ = ["MAGIC", "FMT", "HEAD", "RAW", "INDEX", "Header", "BaseMismatch", "ResultMismatch",
           "encode", "encode_host", "raw_record", "is_record", "parse", "apply", "dense_view", "scatter",
           "record_size", "index_width", "entries_for", "max_changes", "deltable",
           "dtype_code", "header_bytes", "DTYPE_NAMES"]

MAGIC = b"WSDELTA2"
FMT = 2
HEAD = 64
RAW, INDEX = 0, 1
_HEAD = struct.Struct("<8sBBBB4xQQQQQQ")
#: Fixed codes of the dtypes a record may carry (never reordered: both sides agree).
DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
               "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "int8", "int16",
               "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool", "complex64",
               "complex128")
_NP_INDEX = {4: np.int32, 8: np.int64}


class BaseMismatch(Exception):
    """The receiver's tensor is not the base the record was computed against."""


class ResultMismatch(Exception):
    """The record does not match the tensor it is for (its digest over the positions, the
    new values and the values they replace differs from the sender's): nothing written."""


@dataclass(frozen=True)
class Header:
    enc: int
    dtype: torch.dtype
    numel: int
    index_width: int
    count: int         # changed elements (RAW: bytes)
    entries: int       # positions / values the record holds (count rounded up)
    digest: int

    @property
    def values_at(self) -> int:
        """Byte offset of the values section."""
        return HEAD + self.entries * self.index_width

    @property
    def size(self) -> int:
        """Bytes of the whole record."""
        if self.enc == RAW:
            return HEAD + self.count
        return self.values_at + self.entries * self.dtype.itemsize


def index_width(n: int) -> int:
    """Bytes per position for a tensor of ``n`` elements."""
    return 4 if n < 1 << 31 else 8


def max_changes(n: int) -> int:
    """Most changed elements a record of an ``n``-element tensor carries (an eighth)."""
    return (n + 7) // 8


def entries_for(count: int) -> int:
    """``count`` rounded up to a multiple of 8 and one of 8 steps per power of two."""
    if count <= 0:
        return 0
    step = max(8, 1 << max(0, count.bit_length() - 4))
    return (count + step - 1) // step * step


def record_size(shape: Sequence[int], itemsize: int, changed: int) -> Optional[int]:
    """Bytes of the record :func:`encode` makes when ``changed`` elements of a tensor of
    ``shape`` (elements of ``itemsize`` bytes) differ from its base; None when the tensor
    goes dense (more than :func:`max_changes`, elements of another size, or a record no
    smaller than the tensor)."""
    n = math.prod(shape)
    if itemsize not in (1, 2, 4, 8) or changed > max_changes(n):
        return None
    size = HEAD + entries_for(changed) * (index_width(n) + itemsize)
    return None if size >= n * itemsize else size


def deltable(t: torch.Tensor) -> bool:
    """Whether :func:`encode` may diff ``t`` (else it always goes dense)."""
    return (t.element_size() in (1, 2, 4, 8) and t.numel() > 0
            and not (t.dtype == torch.uint8 and t.dim() == 1)
            and dtype_name(t.dtype) in DTYPE_NAMES)


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPE_NAMES.index(dtype_name(dtype))


def header_bytes(enc: int, dtype: torch.dtype, numel: int, count: int, entries: int,
                 digest: int) -> bytes:
    iw = index_width(numel) if enc == INDEX else 0
    return _HEAD.pack(MAGIC, FMT, enc, dtype_code(dtype), iw, numel, count, entries,
                      digest & ((1 << 64) - 1), 0, 0)


def _host(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def encode(new: torch.Tensor, base: torch.Tensor) -> tuple[Optional[torch.Tensor], int]:
    """``(record, changed)``: the record of ``new`` against ``base`` (None: send ``new``
    dense), and how many elements changed. ``new`` and ``base``: contiguous, same dtype,
    shape and device; ``base`` is left alone."""
    if not deltable(new):
        return None, int(new.numel())
    if new.device.type != "cpu":      # one tensor at a time: the batched kernels are .gpu's
        rec, idx = encode_host(new.cpu(), base.cpu())
        return (None if rec is None else rec.to(new.device)), idx.numel()
    rec, idx = encode_host(new, base)
    return rec, idx.numel()


def encode_host(new: torch.Tensor, base: torch.Tensor
                ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """:func:`encode` of host tensors (``new`` :func:`deltable`), with the changed
    positions themselves (sorted int64, for :func:`scatter`)."""
    idx = kernels.changed(new, base)
    return _index_record(new, idx, kernels.gather(new, idx), kernels.gather(base, idx)), idx


def _index_record(new: torch.Tensor, idx: torch.Tensor, values: torch.Tensor,
                  old: torch.Tensor) -> Optional[torch.Tensor]:
    n, k, m = new.numel(), new.element_size(), idx.numel()
    if record_size(tuple(new.shape), k, m) is None:
        return None
    e, iw = entries_for(m), index_width(n)
    rec = np.zeros(HEAD + e * (iw + k), dtype=np.uint8)
    rec[:HEAD] = np.frombuffer(header_bytes(INDEX, new.dtype, n, m, e,
                                            kernels.change_digest(idx, old, values)),
                               dtype=np.uint8)
    rec[HEAD: HEAD + m * iw].view(_NP_INDEX[iw])[:] = idx.numpy()
    at = HEAD + e * iw
    rec[at: at + m * k] = values.reshape(-1).view(torch.uint8).numpy()
    return torch.from_numpy(rec)


def raw_record(t: torch.Tensor) -> torch.Tensor:
    """A dense 1-D ``uint8`` tensor's bytes in a record (for one that looks like a record)."""
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    head = _host(header_bytes(RAW, torch.uint8, flat.numel(), flat.numel(), 0, 0))
    return torch.cat([head.to(flat.device), flat])


def is_record(t: torch.Tensor) -> bool:
    """A 1-D ``uint8`` tensor that starts with the magic (reads 8 bytes on the host)."""
    if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() < HEAD:
        return False
    return bytes(t[:8].cpu().numpy()) == MAGIC


def _bad(why: str) -> WireError:
    return WireError(f"malformed delta record: {why}", phase="receive")


def parse(rec: torch.Tensor) -> Header:
    """The header of a record (read on the host); ``WireError`` for anything inconsistent."""
    if not is_record(rec):
        raise _bad("no magic")
    raw = bytes(rec[:HEAD].cpu().numpy())
    (_, fmt, enc, code, iw, numel, count, entries, dig, r1, r2) = _HEAD.unpack(raw)
    if fmt != FMT or enc not in (RAW, INDEX) or code >= len(DTYPE_NAMES) or r1 or r2:
        raise _bad(f"fmt={fmt} enc={enc} dtype={code}")
    try:
        dtype = dtype_from_name(DTYPE_NAMES[code])
    except ValueError:
        raise _bad(f"dtype {DTYPE_NAMES[code]} unavailable here") from None
    if enc == RAW:
        if dtype != torch.uint8 or count != numel or iw or entries:
            raise _bad("inconsistent raw record")
    elif iw != index_width(numel) or count > entries or entries != entries_for(count) \
            or count > max_changes(numel) or dtype.itemsize not in (1, 2, 4, 8):
        raise _bad(f"count {count} / {entries} entries of {numel} elements, width {iw}")
    head = Header(enc, dtype, numel, iw, count, entries, dig)
    if rec.numel() != head.size:
        raise _bad(f"{rec.numel()} bytes, the header says {head.size}")
    return head


def dense_view(head: Header, rec: torch.Tensor) -> torch.Tensor:
    """The tensor a ``RAW`` record carries (a view into ``rec``)."""
    return rec[HEAD: HEAD + head.count]


def apply(head: Header, rec: torch.Tensor, dest: torch.Tensor) -> None:
    """Write an ``INDEX`` record into ``dest`` (its base), after checking it: a dest of
    another dtype or size is ``BaseMismatch``; a position out of range is ``WireError``; a
    digest that differs (a corrupted record, or a base that differs where the record
    changes it) is ``ResultMismatch``. Nothing is written unless every check passed."""
    if head.enc == RAW:
        raise ValueError("a RAW record is dense: use dense_view")
    if dest.dtype != head.dtype or dest.numel() != head.numel or not dest.is_contiguous():
        raise BaseMismatch(f"holds {dest.dtype} of {dest.numel()} elements, the record is "
                           f"for {head.dtype} of {head.numel}")
    if dest.device.type != "cpu":     # one tensor at a time: the batched kernels are .gpu's
        host = dest.cpu()
        apply(head, rec.cpu(), host)
        dest.copy_(host)
        return
    m, iw, k = head.count, head.index_width, head.dtype.itemsize
    raw = rec.numpy()
    idx = raw[HEAD: HEAD + m * iw].view(_NP_INDEX[iw])
    if m and (int(idx.min()) < 0 or int(idx.max()) >= head.numel):
        raise _bad("index out of range")
    view = kernels.int_view(dest)
    values = raw[head.values_at: head.values_at + m * k].view(view.numpy().dtype)
    pos = torch.from_numpy(idx.astype(np.int64))
    old = kernels.gather(dest, pos)
    if kernels.change_digest(pos, old, torch.from_numpy(values)) != head.digest:
        raise ResultMismatch("the record does not match the tensor it is for (digest)")
    view.numpy()[idx] = values


def scatter(base: torch.Tensor, new: torch.Tensor, idx: torch.Tensor) -> None:
    """Make ``base`` equal ``new`` by writing only the changed elements (``idx``), or all
    of them where that many changed (host tensors)."""
    if idx.numel() == 0:
        return
    if idx.numel() * 8 > new.numel():
        base.copy_(new)
        return
    kernels.put(base, idx, kernels.gather(new, idx))
