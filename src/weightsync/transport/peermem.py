"""Reading a peer process's CPU tensors that live in torch's shared memory.

``model.share_memory()`` (or ``tensor.share_memory_()``) puts a CPU tensor's storage in a
shared-memory file that the owning process keeps open (torch's default
``file_descriptor`` sharing strategy: the file is unlinked at once, only the descriptor
keeps it). A process allowed to inspect the owner (the same permission as cross-memory
attach) can open that descriptor through ``/proc/<pid>/fd/<n>``, map the file, and copy
the bytes with ``memcpy`` at the memory's full speed, instead of asking the kernel to
read the other address space page by page (``process_vm_readv``, slower per thread).

Sender side: :func:`shared_ref` names a tensor's bytes as ``(fd, inode, storage bytes,
byte offset)``, or ``None`` when its storage is not shared that way. Receiver side:
:class:`PeerMaps` maps what a ref names, once, checks the inode (a descriptor number may be
reused for another file), and keeps the mapping for the next sync; mappings not used by
a sync are dropped at its end, so a receiver never keeps more of the peer's memory
mapped than one sync's tensors (a mapping keeps the file alive after the peer freed it).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import warnings
from typing import Callable, Optional

import torch

__all__ = ["SharedRef", "shared_ref", "PeerMaps"]

logger = logging.getLogger(__name__)

#: ``(fd, inode, storage nbytes, byte offset of the tensor in its storage)``
SharedRef = tuple[int, int, int, int]


def shared_ref(tensor: torch.Tensor) -> Optional[SharedRef]:
    """Where another process can map ``tensor``'s bytes: a contiguous CPU tensor whose
    storage torch shared with the ``file_descriptor`` strategy; else ``None``. Never moves
    a storage (``_share_fd_cpu_`` would copy one shared another way into a new file; the
    descriptor is only looked up)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    storage = tensor.untyped_storage()
    if not storage.is_shared():
        return None
    base, size = storage.data_ptr(), storage.nbytes()
    try:
        fd = storage._get_shared_fd()
        inode = os.fstat(fd).st_ino
    except (RuntimeError, OSError, TypeError, ValueError, AttributeError):
        return None
    offset = tensor.data_ptr() - base
    nbytes = tensor.numel() * tensor.element_size()
    if offset < 0 or offset + nbytes > size:
        return None
    return int(fd), int(inode), int(size), int(offset)


class PeerMaps:
    """A receiver's mappings of peers' shared storages, keyed by (pid, fd, inode).

    :meth:`view` gives the mapped storage as bytes (``None`` if it cannot be opened: the
    caller falls back to another way of reading); :meth:`end_sync` drops what the sync
    did not use; :meth:`close` drops everything. Thread-safe (one pump thread per stream).
    ``writable``: map for writing (a trainer writing into a receiver's tensors);
    ``on_map``/``on_drop``: called with each new mapping / before one is dropped (a GPU
    trainer registers the memory as pinned, and unregisters it).
    """

    def __init__(self, *, writable: bool = False, on_map: Optional[Callable] = None,
                 on_drop: Optional[Callable] = None) -> None:
        self._writable, self._on_map, self._on_drop = writable, on_map, on_drop
        self._maps: dict[tuple[int, int, int], tuple[int, torch.Tensor]] = {}
        self._used: set[tuple[int, int, int]] = set()
        self._denied: set[int] = set()      # pids whose descriptors we may not open
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._maps)

    def view(self, pid: int, ref: SharedRef) -> Optional[torch.Tensor]:
        fd, inode, size, _ = ref
        key = (pid, fd, inode)
        with self._lock:
            hit = self._maps.get(key)
            if hit is not None and hit[0] >= size:
                self._used.add(key)
                return hit[1]
            if pid in self._denied:
                return None
        mapped = self._map(pid, fd, inode, size)
        if mapped is not None and self._on_map is not None:
            self._on_map(mapped)
        with self._lock:
            if mapped is None:
                return None
            old = self._maps.get(key)
            if old is not None and self._on_drop is not None:
                self._on_drop(old[1])
            self._maps[key] = (size, mapped)
            self._used.add(key)
        return mapped

    def _map(self, pid: int, fd: int, inode: int, size: int) -> Optional[torch.Tensor]:
        try:
            own = os.open(f"/proc/{pid}/fd/{fd}",
                          (os.O_RDWR if self._writable else os.O_RDONLY) | os.O_CLOEXEC)
        except PermissionError as exc:
            logger.info("cannot open the shared storages of pid %d (%s): reading them "
                        "another way", pid, exc)
            with self._lock:
                self._denied.add(pid)
            return None
        except OSError:          # the descriptor is gone (the storage was freed)
            return None
        try:
            st = os.fstat(own)
            if st.st_ino != inode or st.st_size < size:
                return None      # the number names another file now
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if self._writable else 0)
            mm = mmap.mmap(own, size, flags=mmap.MAP_SHARED, prot=prot)
        except (OSError, ValueError):
            return None
        finally:
            os.close(own)
        with warnings.catch_warnings():   # read-only unless writable: only read from then
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mm, dtype=torch.uint8)

    def end_sync(self) -> int:
        """Drop the mappings the sync that just ended did not use; returns how many."""
        with self._lock:
            stale = [k for k in self._maps if k not in self._used]
            for k in stale:
                _, mapped = self._maps.pop(k)     # unmapped once no tensor refers to it
                if self._on_drop is not None:
                    self._on_drop(mapped)
            self._used.clear()
            return len(stale)

    def close(self) -> None:
        with self._lock:
            if self._on_drop is not None:
                for _, mapped in self._maps.values():
                    self._on_drop(mapped)
            self._maps.clear()
            self._used.clear()
            self._denied.clear()
