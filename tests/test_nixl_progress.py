"""NIXL's progress thread: NIXL's Python config runs it with no pause between polls, a core per agent whether it moves bytes or not. Receivers'
agents run without it by default (they progress their reads as they poll them; a joiner
reading from one is served by a poller: ``test_nixl.py``'s receiver-serves-a-joiner test
hangs without that poller); trainers' agents keep it."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("nixl")

from weightsync import CheckpointEngineRegistry  # noqa: E402
from weightsync.transport.backends.nixl.agent import NixlAgent, Poller  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _idle_cpu(agent_kw: dict, seconds: float = 0.6) -> float:
    """CPU seconds this process spends while one agent of ``agent_kw`` sits idle."""
    agent = NixlAgent(f"idle-{time.monotonic_ns()}", **agent_kw)
    try:
        time.sleep(0.1)
        start = time.process_time()
        time.sleep(seconds)
        return time.process_time() - start
    finally:
        agent.close()


def test_an_agent_without_the_progress_thread_leaves_the_cores_idle():
    """Measured in one run: NIXL's thread spins while nothing moves; without it the idle
    agent costs (almost) nothing."""
    spinning = _idle_cpu({"progress_thread": True})
    quiet = _idle_cpu({"progress_thread": False})
    assert quiet < 0.2 * spinning, (quiet, spinning)


def test_cpu_receivers_run_without_it_gpu_receivers_keep_it():
    cls = CheckpointEngineRegistry.get("nixl")
    eng = cls(role="rollout")
    agent = eng._reader_agent(f"rx-{time.monotonic_ns()}")
    try:
        assert agent.progress_thread is False
    finally:
        agent.close()


def test_a_poller_refuses_an_agent_with_the_thread_and_a_bad_interval():
    spinning = NixlAgent(f"poll-bad-{time.monotonic_ns()}", progress_thread=True)
    quiet = NixlAgent(f"poll-bad-{time.monotonic_ns()}", progress_thread=False)
    try:
        with pytest.raises(ValueError, match="progress thread already"):
            Poller(spinning)
        with pytest.raises(ValueError, match="interval_s must be > 0"):
            Poller(quiet, interval_s=0)
        poller = Poller(quiet)
        poller.stop()
        assert not poller._thread.is_alive()
    finally:
        spinning.close()
        quiet.close()


class _TrainerCtx:
    """What ``NixlRaw`` asks of the bench's context, for trainer rank 0 alone."""

    rank, is_trainer, receivers, timeout = 0, True, 1, 30.0

    def __init__(self, nbytes: int) -> None:
        self.workload = type("W", (), {"nbytes": nbytes})()

    def gather(self, obj):
        return [obj]


def test_the_benchs_raw_read_keeps_no_core_of_the_trainer_busy():
    """The bench runs ``nixl-raw`` beside ``nixl`` in the same processes: its trainer-side
    agent, alive through the engine's steps too, must not spin a core (it made the engine's
    not-pipelined 1 GiB sync 0.33 -> 0.45 s here). Compared in one run with an agent that
    runs NIXL's thread."""
    from weightsync.tools.bench.methods import NixlRaw
    spinning = _idle_cpu({"progress_thread": True})
    raw = NixlRaw(_TrainerCtx(1 << 20), {})
    raw.setup()
    try:
        assert raw.poller is not None and not raw.agent.progress_thread
        time.sleep(0.1)
        start = time.process_time()
        time.sleep(0.6)
        busy = time.process_time() - start
    finally:
        raw.teardown()
    assert busy < 0.2 * spinning, (busy, spinning)


def test_a_lease_opened_as_the_lease_poller_ends_starts_a_poller_of_its_own():
    """The lease poller ends once ``_leased`` finds no lease open. That answer forgets it
    under the lease lock, so a lease granted while its thread is still winding down starts
    a new poller (before, the grant saw a poller still running and relied on it: the
    joiner's reads went unanswered until it timed out)."""
    import threading
    from weightsync.transport.backends.nixl.engine import NixlEngine
    agent = NixlAgent(f"lease-race-{time.monotonic_ns()}", progress_thread=False)
    eng = object.__new__(NixlEngine)        # only the lease state the poller touches
    eng._lease_cv, eng._leases, eng._lease_poller = threading.Condition(), {}, None
    told_no, release = threading.Event(), threading.Event()

    def needed() -> bool:
        answer = eng._leased()
        if not answer:                   # the poller's thread lingers after its last answer
            told_no.set()
            release.wait(10)
        return answer
    try:
        with eng._lease_cv:
            eng._lease_poller = poller = Poller(agent, 1e-3, needed=needed)
        assert told_no.wait(10)
        assert poller._thread.is_alive()
        with eng._lease_cv:            # what a grant checks before it starts a poller
            assert eng._lease_poller is None
    finally:
        release.set()
        poller.stop()
        agent.close()
