"""The NCCL-only parts of ``collective`` that can be checked without two GPUs: how a
broadcast's completion is awaited (bounded, polled) and what happens on a hang."""

import time

import pytest

from weightsync import CheckpointEngineRegistry
from weightsync.core.errors import PeerFailed, SyncTimeout


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
    e.checks = 0

    def check_receivers(version):  # the trainer's look at its control channel
        e.checks += 1
    e._check_receivers = check_receivers
    yield e
    e._groups = {}


def test_waits_until_completed_watching_the_receivers(engine):
    work = FakeWork(0.2)
    start = time.monotonic()
    engine._wait_work(work, 3)
    assert time.monotonic() - start >= 0.19
    assert work.waited == 1 and engine.checks >= 1


def test_hang_becomes_sync_timeout_and_aborts(engine):
    FakePG.aborted = 0
    start = time.monotonic()
    with pytest.raises(SyncTimeout) as info:
        engine._wait_work(FakeWork(60), 3)
    assert 0.25 < time.monotonic() - start < 10.0  # bounded (loose: CI machines are busy)
    assert info.value.peer == "rollout ranks" and info.value.version == 3
    assert FakePG.aborted == 1


def test_a_receiver_waits_longer_than_the_trainer(engine):
    start = time.monotonic()
    with pytest.raises(SyncTimeout) as info:
        engine._wait_work(FakeWork(60), 3, stream=1, seq=2)
    assert time.monotonic() - start > 1.25      # patience: 0.3 s + 1 s
    assert info.value.peer == "trainer rank 1" and engine.checks == 0


def test_recorded_error_is_raised(engine):
    engine._cause_of_broken_group = lambda stream, seq, version: None   # nobody reported
    with pytest.raises(SyncTimeout, match="boom"):
        engine._wait_work(FakeWork(0, RuntimeError("NCCL error: boom")), 1, stream=0)


def test_a_broken_group_raises_the_report_that_names_who_failed(engine):
    def report(version):
        raise PeerFailed("lost the control link to rollout rank 2", peer="rollout rank 2")
    engine._check_receivers = report
    with pytest.raises(PeerFailed) as info:
        engine._wait_work(FakeWork(0, RuntimeError("gloo: connection reset")), 1)
    assert info.value.peer == "rollout rank 2"
