"""NIXL's progress thread (``WEIGHTSYNC_NIXL_PROGRESS_THREAD``): NIXL's Python config runs it
with no pause between polls, a core per agent whether it moves bytes or not. Receivers'
agents run without it by default (they progress their reads as they poll them; a joiner
reading from one is served by a poller: ``test_nixl.py``'s receiver-serves-a-joiner test
hangs without that poller); trainers' agents keep it."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("nixl")

from weightsync import CheckpointEngineRegistry  # noqa: E402
from weightsync.transport.backends.nixl.agent import (NixlAgent,  # noqa: E402
                                                    receivers_progress_thread)

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


def test_receivers_run_without_it_by_default_and_all_gives_every_agent_one(monkeypatch):
    monkeypatch.delenv("WEIGHTSYNC_NIXL_PROGRESS_THREAD", raising=False)
    assert receivers_progress_thread() is False
    cls = CheckpointEngineRegistry.get("nixl")
    assert cls(role="rollout")._rx_progress_thread is False
    monkeypatch.setenv("WEIGHTSYNC_NIXL_PROGRESS_THREAD", "all")
    assert cls(role="rollout")._rx_progress_thread is True    # read at construction
    monkeypatch.setenv("WEIGHTSYNC_NIXL_PROGRESS_THREAD", "off")
    with pytest.raises(ValueError, match="WEIGHTSYNC_NIXL_PROGRESS_THREAD must be auto or all"):
        cls(role="rollout")
