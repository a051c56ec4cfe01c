"""``sweep_stale`` judges a segment by its owner's lock, not by the pid in its name: a pid
means nothing across PID namespaces that share /dev/shm (and pids are reused)."""

import os
import secrets
import subprocess
import sys
import textwrap

import pytest

from weightsync.transport.backends.shm.segments import SHM_DIR, Segment, sweep_stale

SIZE = 4096

_OWNER = textwrap.dedent("""
    import os, sys
    from weightsync.transport.backends.shm.segments import Segment
    seg = Segment(sys.argv[1], int(sys.argv[2]), create=True)
    print("ready", flush=True)
    if sys.argv[3] == "die":
        os._exit(9)          # no unlink, no atexit: a crash
    sys.stdin.readline()     # alive until told
    seg.close()
""")


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _name(pid: int) -> str:
    return f"weightsync-{pid}-{secrets.token_hex(8)}-0-0"


def _owner(name: str, mode: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _OWNER, name, str(SIZE), mode],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


@pytest.mark.timeout(60)
def test_live_owner_with_a_foreign_pid_in_the_name_is_not_swept():
    """As seen from another PID namespace: the owner is alive, the pid in the name is not
    (or is someone else's) here."""
    name = _name(_dead_pid())
    owner = _owner(name, "live")
    try:
        sweep_stale()
        assert _exists(name), "a live owner's segment was unlinked"
        Segment(name, SIZE, create=False).close()   # and it still opens
    finally:
        owner.communicate("\n", timeout=30)
    assert not _exists(name)


@pytest.mark.timeout(60)
def test_dead_owner_is_swept_whatever_pid_the_name_holds():
    """The owner crashed before unlinking; the pid in the name belongs to a live process
    (here: this one's parent), as after pid reuse or in another namespace."""
    name = _name(os.getppid())
    owner = _owner(name, "die")
    assert owner.wait(timeout=30) == 9
    assert _exists(name)
    try:
        assert sweep_stale() >= 1
        assert not _exists(name)
    finally:
        if _exists(name):
            os.unlink(os.path.join(SHM_DIR, name))


def test_own_segments_are_kept_and_still_work():
    seg = Segment(Segment.make_name(secrets.token_hex(8), 0, 0), SIZE, create=True)
    try:
        sweep_stale()
        assert _exists(seg.name)
        reader = Segment(seg.name, SIZE, create=False)
        seg.tensor[:4] = 7
        assert reader.tensor[:4].tolist() == [7, 7, 7, 7]
        seg.unlink()
        assert not _exists(seg.name)
        reader.close()
    finally:
        seg.close()


def test_an_unlocked_leftover_is_swept_even_when_its_pid_is_alive():
    """A leftover without any owner (created, never locked: e.g. by a writer killed at
    once) goes too, also when its name holds a live pid."""
    name = _name(os.getppid())
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    try:
        sweep_stale()
        assert not _exists(name)
    finally:
        if _exists(name):
            os.unlink(os.path.join(SHM_DIR, name))
