"""Engine-level fault injection: dead peers, missing peers, corrupted buckets."""

import re
import time

import pytest

import faults
from weightsync.testing import GroupSpec, run_group

BUCKET = 64 * 1024
PROCESS_BACKENDS = ["shm", "collective"]
TIMEOUT = 6  # the engines' timeout; time bounds are multiples of it, never of the box's speed


def _spec(backend, hook, **kw):
    engine_kwargs = {"bucket_size": BUCKET, "timeout": TIMEOUT, **kw.pop("engine_kwargs", {})}
    kw.setdefault("timeout", 60)
    kw.setdefault("steps", 3)
    kw.setdefault("receivers", 2)
    return GroupSpec(backend=backend, hook=hook, tiny=100,
                     engine_kwargs=engine_kwargs, **kw)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", PROCESS_BACKENDS)
def test_rollout_killed_mid_sync(backend):
    trainer, r0, r1 = run_group(_spec(backend, "faults:kill_rollout_1"))
    assert r1 == {"died": 17}
    assert len(trainer["steps"]) == 1 and trainer["errors"], trainer
    assert "rollout rank" in trainer["errors"][0]
    assert len(r0["steps"]) == 1 and r0["errors"], r0   # told, not left waiting
    # bounded by the timeout (start-up of the processes not counted)
    assert trainer["failed_after_s"] < 3 * TIMEOUT, trainer
    assert r0["failed_after_s"] < 3 * TIMEOUT, r0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", PROCESS_BACKENDS)
def test_relayed_errors_keep_their_origin(backend):
    """Two trainer ranks, three rollout ranks, rank 2 dies: its failure reaches every other
    worker, directly or passed on by a peer, and no error blames a surviving rollout rank
    (the manager isolates by these origins)."""
    spec = _spec(backend, "faults:kill_rollout_2", trainers=2, receivers=3, hold=True)
    *trainers, r0, r1, r2 = run_group(spec)
    assert r2 == {"died": 17}
    for w in trainers:
        assert len(w["steps"]) == 1 and w["origins"] == ["rollout rank 2"], w
    for w in (r0, r1):
        assert w["errors"] and w["origins"][0] not in ("rollout rank 0", "rollout rank 1"), w


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", PROCESS_BACKENDS)
def test_trainer_killed_mid_sync(backend):
    trainer, r0, r1 = run_group(_spec(backend, "faults:kill_trainer_0"))
    assert trainer == {"died": 17}
    for r in (r0, r1):
        assert len(r["steps"]) == 1 and r["errors"], r
        assert "trainer rank 0" in r["errors"][0], r["errors"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", PROCESS_BACKENDS)
def timed_never_init_rollout_1(engine, role, rank):
    """``faults.never_init_rollout_1``, and every other worker's failed init says how long
    it took (a note on its exception, in the reported traceback)."""
    faults.never_init_rollout_1(engine, role, rank)
    if role == "rollout" and rank == 1:
        return
    init = engine.init_process_group

    def timed(**kwargs):
        start = time.monotonic()
        try:
            return init(**kwargs)
        except BaseException as exc:
            exc.add_note(f"init failed after {time.monotonic() - start:.3f} s")
            raise
    engine.init_process_group = timed


def _init_failed_after(report: str) -> float:
    m = re.search(r"init failed after ([0-9.]+) s", report)
    assert m, report
    return float(m.group(1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", PROCESS_BACKENDS)
def test_peer_that_never_arrives(backend):
    # the harness' deadline also covers starting the processes (spawn + imports), which on
    # a loaded 2-core box took over 16 s once: it bounds the test, not what is tested.
    # The stuck rank counts as hung once the others have reported and 2 timeouts passed.
    trainer, r0, r1 = run_group(_spec(backend, "test_faults:timed_never_init_rollout_1",
                                      timeout=40, straggler_s=2 * TIMEOUT))
    assert "fatal" in trainer, trainer
    assert "SyncTimeout" in trainer["fatal"]
    assert r1 == {"hung": "result"}
    assert "fatal" in r0 or r0["errors"], r0     # the healthy rollout rank is told too
    # the trainer gives up after about its timeout, not at the harness' deadline (a
    # bound in timeouts: the start-up of processes on a loaded box is not counted)
    assert _init_failed_after(trainer["fatal"]) < 2.5 * TIMEOUT, trainer
    if "fatal" in r0:
        assert _init_failed_after(r0["fatal"]) < 3 * TIMEOUT, r0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", PROCESS_BACKENDS)
def test_corrupted_bucket_detected_with_checksums(backend):
    spec = _spec(backend, "faults:corrupt_rollout_0", engine_kwargs={"checksum": True})
    trainer, r0, r1 = run_group(spec)
    assert r0["errors"] and r0["errors"][0].startswith("IntegrityError"), r0


@pytest.mark.timeout(120)
def test_corruption_without_checksums_is_what_the_option_is_for():
    trainer, r0, r1 = run_group(_spec("shm", "faults:corrupt_rollout_0"))
    assert not r0["errors"]
    assert any(step["bad"] for step in r0["steps"])  # the fault really corrupts bytes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", PROCESS_BACKENDS)
def test_failed_receiver_that_stays_alive_fails_the_trainer_fast(backend):
    """The trainer learns of a receiver's failure from the control channel, not at the
    timeout, even while a broadcast waits for that (live) receiver."""
    timeout = 40
    spec = _spec(backend, "faults:linger_rollouts_on_error", steps=1, expect_version_offset=7,
                 engine_kwargs={"timeout": timeout})
    trainer, r0, r1 = run_group(spec)
    assert r0["errors"][0].startswith("VersionMismatch"), r0
    assert trainer["errors"], trainer
    # neither the timeout nor the lingering receiver's exit told it
    assert trainer["failed_after_s"] < min(timeout / 4, faults.LINGER_S / 2), trainer
