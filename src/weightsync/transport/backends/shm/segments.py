"""Shared-memory segments under /dev/shm that never outlive their job.

The writer creates each segment with a name that holds its pid and a random token, maps
it (pre-faulted), and unlinks it as soon as every reader has mapped it: from then on the
memory lives only as long as the mappings, so a crash of any process leaks nothing.
Segments of dead writers that crashed before that point are swept at the next creation
and at interpreter exit.
"""

from __future__ import annotations

import atexit
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> int:
    """Unlink segments whose creating process is dead; returns how many."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        m = _NAME_RE.match(name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
            except OSError:
                pass
    return removed


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
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
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
        finally:
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

    def close(self) -> None:
        self.unlink()
        self.tensor = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # a consumer still holds a view; the mapping goes with the last one
