"""A process that finalizes after a failed ``collective`` sync exits promptly: the groups
of the aborted sync (whose teardown waits out gloo operations a live peer never matches)
are dropped by a daemon thread, not waited for at interpreter exit."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed")

from exitworker import TIMEOUT  # noqa: E402

WORKER = Path(__file__).with_name("exitworker.py")


def _run(mode: str) -> tuple[dict, float]:
    """Run the worker; its lines by first word, and the seconds from ``FINALIZED`` to
    its exit."""
    proc = subprocess.Popen([sys.executable, str(WORKER), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    lines: dict = {}
    finalized = None
    for line in proc.stdout:
        word, _, rest = line.strip().partition(" ")
        lines[word] = rest
        if word == "FINALIZED":
            finalized = time.monotonic()
    proc.wait(timeout=120)
    exited = time.monotonic()
    err = proc.stderr.read()
    assert proc.returncode == 0 and finalized is not None, (proc.returncode, lines, err[-3000:])
    return lines, exited - finalized


@pytest.mark.timeout(300)
def test_exit_after_a_failed_collective_sync_does_not_wait_for_the_teardown():
    lines, _ = _run("join")                 # the baseline: how long the teardown takes
    assert lines["SEND"] != "sent", lines
    teardown = float(lines["TEARDOWN"])
    lines, exit_s = _run("exit")
    assert lines["SEND"] != "sent", lines
    # the teardown waits out the stuck operations (about the engines' timeout); the exit
    # of a process that does not wait for it takes a small part of that
    assert teardown > TIMEOUT / 2, teardown
    assert exit_s < teardown / 4, (exit_s, teardown)
