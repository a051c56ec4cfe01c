"""Byte copies of the CPU data path that do not depend on torch's intra-op thread pool.

``Tensor.copy_`` splits a copy over torch's OpenMP threads. When the cores are shared by
more processes than cores (a trainer and several rollout workers on one host), each
parallel region waits for a descheduled thread, and a small copy then runs many times
slower than one thread alone would. The data path therefore copies contiguous bytes
with ``memmove`` (one thread, the GIL released), and reads another process's memory with
``process_vm_readv`` (cross-memory attach) where the kernel allows it. Anything else
(casts, strided tensors, devices) falls back to ``copy_``.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from typing import Any, Optional

import torch

__all__ = ["copy_into", "memmove_at", "memmove_from", "can_memmove", "cma_read", "cma_available",
           "copy_threads", "split_memmove"]

logger = logging.getLogger(__name__)

_memmove = ctypes.memmove


def can_memmove(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.is_cpu and src.is_cpu and dst.dtype == src.dtype
            and dst.is_contiguous() and src.is_contiguous() and dst.numel() == src.numel()
            and not src.is_conj() and not src.is_neg())


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (same number of elements), by ``memmove`` where possible."""
    if can_memmove(dst, src):
        n = dst.numel() * dst.element_size()
        if n:
            _memmove(dst.data_ptr(), src.data_ptr(), n)
        return
    dst.copy_(src.reshape(dst.shape) if src.shape != dst.shape else src)


def memmove_at(buf: torch.Tensor, offset: int, src: torch.Tensor, nbytes: int) -> None:
    """``nbytes`` of contiguous CPU ``src`` to byte ``offset`` of contiguous CPU ``buf``
    (the caller vouches for both; bounds are checked here), by ``memmove``."""
    if offset < 0 or offset + nbytes > buf.numel() * buf.element_size() \
            or nbytes > src.numel() * src.element_size():
        raise ValueError(f"memmove_at: {nbytes} bytes at {offset} do not fit")
    _memmove(buf.data_ptr() + offset, src.data_ptr(), nbytes)


def memmove_from(dst: torch.Tensor, buf: torch.Tensor, offset: int, nbytes: int) -> None:
    """``nbytes`` from byte ``offset`` of contiguous CPU ``buf`` to contiguous CPU ``dst``."""
    if offset < 0 or offset + nbytes > buf.numel() * buf.element_size() \
            or nbytes > dst.numel() * dst.element_size():
        raise ValueError(f"memmove_from: {nbytes} bytes at {offset} do not fit")
    _memmove(dst.data_ptr(), buf.data_ptr() + offset, nbytes)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc: Optional[ctypes.CDLL] = None
_readv = None


def _load() -> bool:
    global _libc, _readv
    if _readv is not None:
        return True
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        fn = _libc.process_vm_readv
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    _readv = fn
    return True


#: one syscall moves at most this much (keeps page pinning in the kernel short)
_STEP = 64 << 20


#: reads at least this big are split over the copy threads
SPLIT_MIN = 8 << 20


#: at most this many copy threads per receiver when they are sized from the host's cores
AUTO_MAX_THREADS = 16


def copy_threads(sharers: int | None = None, *, threads: int | None = None) -> int:
    """Threads one big copy or cross-memory read is split over: ``threads`` when given
    (``ShmOptions.copy_threads``, ``WEIGHTSYNC_COPY_THREADS``); else, given ``sharers``
    (the receivers that copy on this host at once), the host's cores shared among them, at
    most :data:`AUTO_MAX_THREADS`; else min(4, cores)."""
    if threads is not None:
        return threads
    cores = os.cpu_count() or 1
    if sharers is not None:
        return max(1, min(AUTO_MAX_THREADS, cores // max(1, int(sharers))))
    return max(1, min(4, cores))


def _read_range(pid: int, remote: int, local: int, total: int) -> None:
    off = 0
    while off < total:
        n = min(_STEP, total - off)
        lv, rv = _IoVec(local + off, n), _IoVec(remote + off, n)
        got = _readv(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise OSError(err or errno.EIO, f"process_vm_readv from pid {pid}: "
                          f"{os.strerror(err) if err else 'short read'}")
        off += got


def cma_read(pid: int, remote_addr: int, dst: torch.Tensor, pool: Any = None,
             parts: int = 1) -> None:
    """Copy ``dst``'s size in bytes from ``remote_addr`` in process ``pid`` into ``dst``.

    With ``pool`` (a ``ThreadPoolExecutor`` of ``parts - 1`` threads), a big read is split
    in ``parts``, one done by the calling thread: one
    thread's ``process_vm_readv`` reaches about half of ``memcpy`` speed (it pins the
    remote pages one by one), several together reach it. Raises ``OSError`` on failure
    (permission, dead process, bad address).
    """
    if not _load():
        raise OSError(errno.ENOSYS, "process_vm_readv is not available")
    if not dst.is_contiguous() or dst.device.type != "cpu":
        raise ValueError("cma_read needs a contiguous CPU tensor")
    _split(lambda local, remote, n: _read_range(pid, remote, local, n), dst.data_ptr(),
           remote_addr, dst.numel() * dst.element_size(), pool, parts)


def split_memmove(dst_addr: int, src_addr: int, total: int, pool: Any = None,
                  parts: int = 1) -> None:
    """``memmove`` of ``total`` bytes from ``src_addr`` to ``dst_addr`` (the caller vouches
    for both ranges), split like :func:`cma_read` when ``pool`` has threads."""
    _split(ctypes.memmove, dst_addr, src_addr, total, pool, parts)


def _split(fn: Any, dst: int, src: int, total: int, pool: Any, parts: int) -> None:
    """``fn(dst, src, n)`` over ``total`` bytes, in ``parts`` page-aligned pieces on
    ``pool``'s threads and this one when the copy is big enough (:data:`SPLIT_MIN`)."""
    if pool is None or parts < 2 or total < SPLIT_MIN:
        if total:
            fn(dst, src, total)
        return
    step = ((total + parts - 1) // parts + 4095) // 4096 * 4096
    futures = [pool.submit(fn, dst + off, src + off, min(step, total - off))
               for off in range(step, total, step)]
    try:
        fn(dst, src, min(step, total))
    finally:
        for f in futures:
            f.result()


def cma_available(pid: int, remote_addr: int, expect: bytes) -> bool:
    """True if reading ``len(expect)`` bytes at ``remote_addr`` of ``pid`` gives ``expect``."""
    probe = torch.zeros(len(expect), dtype=torch.uint8)
    try:
        cma_read(pid, remote_addr, probe)
    except (OSError, ValueError) as exc:
        logger.debug("cross-memory attach unavailable: %s", exc)
        return False
    return bytes(probe.numpy().tobytes()) == expect
