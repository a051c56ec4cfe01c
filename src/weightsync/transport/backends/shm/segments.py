"""Shared-memory segments under /dev/shm that never outlive their job.

The writer creates each segment with a name that holds its pid and a random token, maps
it (pre-faulted), and unlinks it as soon as every reader has mapped it: from then on the
memory lives only as long as the mappings, so a crash of any process leaks nothing.
Segments of dead writers that crashed before that point are swept at the next creation
and at interpreter exit.

Who is dead is judged by an *owner lock*, never by the pid in the name (pids mean nothing
across PID namespaces that share /dev/shm, and are reused): the writer holds an exclusive
``flock`` on the segment itself from its creation until it unlinks the name, and the
kernel drops that lock when the writer dies, however it dies. A sweeper unlinks a segment
only while it holds that lock itself, i.e. only when no owner does.
"""

from __future__ import annotations

import atexit
import fcntl
import mmap
import os
import re
import threading

import torch

__all__ = ["Segment", "sweep_stale", "SHM_DIR"]

SHM_DIR = "/dev/shm"
_PREFIX = "weightsync-"
_NAME_RE = re.compile(r"^weightsync-(\d+)-[0-9a-f]+-\d+-\d+$")
_live: set[str] = set()
_lock = threading.Lock()


def _sweep_one(path: str) -> bool:
    """Unlink ``path`` if no process holds its owner lock; True if it did."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # gone already, or not ours to open
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its owner is alive (in whatever pid namespace)
        # Locked by us: no owner. It is still the file we opened (not a new one by now)?
        try:
            if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                return False
            os.unlink(path)
        except OSError:
            return False
        return True
    finally:
        os.close(fd)  # drops our lock


def sweep_stale() -> int:
    """Unlink segments that no live process owns (see the module doc); returns how many."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if _NAME_RE.match(name):
            with _lock:
                if name in _live:
                    continue  # ours (our fd holds the lock anyway)
            removed += _sweep_one(os.path.join(SHM_DIR, name))
    return removed


def _create_locked(path: str) -> int:
    """Create ``path`` (exclusively) and take its owner lock. A sweeper holds the lock of
    a fresh, unlocked file for a moment and may unlink it: then create it again."""
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a sweeper holds it at most for an unlink
            if os.fstat(fd).st_nlink > 0:
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # swept between our create and our lock: the name is free again
    raise FileExistsError(f"cannot keep segment {path}: swept again and again")


def _unlink_all() -> None:
    with _lock:
        for name in list(_live):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
        _live.clear()


atexit.register(_unlink_all)


class Segment:
    """One mapped shared-memory buffer, exposed as a flat uint8 tensor."""

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        if "/" in name or not name.startswith(_PREFIX):
            raise ValueError(f"bad segment name {name!r}")
        self.name = name
        self.size = size
        self._lock_fd = -1   # the owner lock: held until the name is unlinked
        path = os.path.join(SHM_DIR, name)
        fd = _create_locked(path) if create else os.open(path, os.O_RDWR, 0o600)
        try:
            if create:
                with _lock:
                    _live.add(name)
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"segment {name} has {os.fstat(fd).st_size} bytes, expected {size}")
            populate = getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if create:
                with _lock:
                    _live.discard(name)
                os.unlink(path)
            os.close(fd)
            raise
        if create:
            self._lock_fd = fd
        else:
            os.close(fd)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._owner = create

    @staticmethod
    def make_name(token: str, stream: int, slot: int) -> str:
        return f"{_PREFIX}{os.getpid()}-{token[:16]}-{stream}-{slot}"

    def unlink(self) -> None:
        """Remove the name (mappings stay valid)."""
        if not self._owner:
            return
        with _lock:
            _live.discard(self.name)
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass
        self._release_lock()

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            os.close(fd)  # after the unlink: nothing left to sweep

    def __del__(self) -> None:
        try:
            self._release_lock()
        except Exception:
            pass

    def close(self) -> None:
        self.unlink()
        self.tensor = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # a consumer still holds a view; the mapping goes with the last one
