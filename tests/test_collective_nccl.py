"""The NCCL-only parts of ``collective`` that can be checked without two GPUs: how a
broadcast's completion is awaited (bounded, polled) and what happens on a hang."""

import time

import pytest

from weightsync import CheckpointEngineRegistry
from weightsync.errors import SyncTimeout


class FakeWork:
    def __init__(self, done_after: float, error: Exception | None = None) -> None:
        self.t_done = time.monotonic() + done_after
        self.error = error
        self.waited = 0

    def is_completed(self) -> bool:
        return time.monotonic() >= self.t_done

    def wait(self, timeout=None) -> bool:
        self.waited += 1
        assert self.is_completed(), "wait() must not be the blocking call on NCCL"
        if self.error is not None:
            raise self.error
        return True


class FakePG:
    aborted = 0

    def abort(self) -> None:
        FakePG.aborted += 1


@pytest.fixture
def engine():
    e = CheckpointEngineRegistry.new("collective", role="trainer", timeout=0.3)
    e._cuda = True  # exercise the NCCL branch of the data path
    e._groups = {0: FakePG()}
    yield e
    e._groups = {}


def test_waits_until_completed(engine):
    work = FakeWork(0.05)
    start = time.monotonic()
    engine._wait_work(work, "rollout ranks", 3)
    assert time.monotonic() - start >= 0.04
    assert work.waited == 1


def test_hang_becomes_sync_timeout_and_aborts(engine):
    FakePG.aborted = 0
    start = time.monotonic()
    with pytest.raises(SyncTimeout) as info:
        engine._wait_work(FakeWork(60), "rollout ranks", 3)
    assert 0.25 < time.monotonic() - start < 10.0  # bounded (loose: CI machines are busy)
    assert info.value.peer == "rollout ranks" and info.value.version == 3
    assert FakePG.aborted == 1


def test_recorded_error_is_raised(engine):
    with pytest.raises(SyncTimeout, match="boom"):
        engine._wait_work(FakeWork(0, RuntimeError("NCCL error: boom")), "trainer rank 0", 1)
