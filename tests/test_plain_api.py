"""The blocking ``engine.send`` / ``engine.receive`` (the conformance suite runs them on
every CPU backend; here: what they do around the transfer) and the quick start example."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import weightsync
from weightsync import CheckpointEngineRegistry, PlanMismatch, SyncStats, SyncTimeout, \
    VersionMismatch
from weightsync.transport.base import worker_kwargs

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def pair():
    """An inproc trainer and rollout engine, joined (the two sides run in two threads)."""
    cls = CheckpointEngineRegistry.get("inproc")
    trainer, rollout = cls(role="trainer", timeout=10), cls(role="rollout", timeout=10)
    tk, rk = cls.build_topology(1, 1, [trainer.prepare(), rollout.prepare()])
    trainer.init_process_group(**worker_kwargs(tk, 0))
    rollout.init_process_group(**worker_kwargs(rk, 0))
    yield trainer, rollout
    trainer.finalize()
    rollout.finalize()


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_send_and_receive_into_a_module_with_stats(pair):
    trainer, rollout = pair
    src, dst = model(0), model(1)
    t, sent = in_thread(trainer.send, src, version=3)
    got = rollout.receive(into=dst, version=3)
    t.join(30)
    for name, p in dst.state_dict().items():
        assert torch.equal(p, src.state_dict()[name]), name
    assert all(p.requires_grad for p in dst.parameters())   # still the module's parameters
    nbytes = sum(p.numel() * p.element_size() for p in src.state_dict().values())
    for stats in (got, sent["value"]):
        assert isinstance(stats, SyncStats)
        assert (stats.version, stats.tensors, stats.bytes) == (3, 4, nbytes)
        assert stats.seconds > 0 and stats.gbps == pytest.approx(nbytes / stats.seconds / 1e9)
        assert "4 tensors" in str(stats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.bytes = 0


def test_receive_without_into_returns_copies_and_casts_into_other_dtypes(pair):
    trainer, rollout = pair
    src = model(0).state_dict()
    t, _ = in_thread(trainer.send, list(src.items()), version="v1")
    got = rollout.receive(version="v1")
    t.join(30)
    assert sorted(got) == sorted(src)
    assert all(torch.equal(got[n], src[n]) and got[n] is not src[n] for n in src)
    # into tensors of another dtype and layout: copied with a cast
    into = {n: torch.zeros(v.shape, dtype=torch.float64).t().contiguous().t() if v.dim() == 2
            else torch.zeros(v.shape, dtype=torch.float64) for n, v in src.items()}
    t, _ = in_thread(trainer.send, src, version=2)
    rollout.receive(into=into, version=2)
    t.join(30)
    assert all(torch.equal(into[n], src[n].double()) for n in src)


def test_strict_names_and_shapes(pair):
    trainer, rollout = pair
    src = model(0).state_dict()
    part = {n: torch.zeros_like(v) for n, v in list(src.items())[:2]}
    t, _ = in_thread(trainer.send, src, version=1)
    with pytest.raises(PlanMismatch, match="2 tensor") as err:
        rollout.receive(into=part, version=1)
    t.join(30)
    assert (err.value.phase, err.value.version) == ("receive", 1)
    assert all(torch.equal(part[n], src[n]) for n in part)    # what fits still landed
    more = dict(part, extra=torch.zeros(3))
    t, _ = in_thread(trainer.send, list(src.items())[:2], version=2)
    stats = rollout.receive(into=more, version=2, strict=False)
    t.join(30)
    assert stats.tensors == 2
    with pytest.raises(PlanMismatch, match="extra"):
        t, _ = in_thread(trainer.send, list(src.items())[:2], version=3)
        try:
            rollout.receive(into=more, version=3)
        finally:
            t.join(30)
    bad = {n: torch.zeros(v.numel() + 1) for n, v in src.items()}
    t, _ = in_thread(trainer.send, src, version=4)
    with pytest.raises(ValueError, match="shape"):
        rollout.receive(into=bad, version=4)
    t.join(30)


def test_a_version_mismatch_is_raised_as_is(pair):
    trainer, rollout = pair
    t, sent = in_thread(trainer.send, model(0), version=5)
    with pytest.raises(VersionMismatch):
        rollout.receive(version=6)
    t.join(30)
    assert isinstance(sent["error"], weightsync.WeightSyncError)


def test_bounded_by_the_timeout_naming_the_peer_phase_and_version(pair):
    _, rollout = pair
    start = time.monotonic()
    with pytest.raises(SyncTimeout) as err:
        rollout.receive(version=7, timeout=0.5)     # no trainer sends
    assert time.monotonic() - start < 5
    assert (err.value.peer, err.value.phase, err.value.version) == ("trainer ranks", "receive", 7)
    assert not [t for t in threading.enumerate() if t.name.startswith("weightsync-receive")]
    with pytest.raises(ValueError, match="timeout"):
        rollout.receive(version=7, timeout=0)


def test_refused_inside_a_running_loop_and_fine_from_its_worker_threads(pair):
    trainer, rollout = pair
    src, dst = model(0), model(1)

    async def blocking_in_the_loop():
        rollout.receive(version=1)

    with pytest.raises(RuntimeError, match="await engine.receive_into"):
        asyncio.run(blocking_in_the_loop())

    async def from_threads():     # a loop runs in this thread; the calls run in others
        return await asyncio.gather(asyncio.to_thread(trainer.send, src, version=1),
                                    asyncio.to_thread(rollout.receive, into=dst, version=1))

    sent, got = asyncio.run(from_threads())
    assert sent.tensors == got.tensors == 4
    assert all(torch.equal(p, src.state_dict()[n]) for n, p in dst.state_dict().items())


def test_bad_weights_are_a_value_error(pair):
    trainer, rollout = pair
    for bad in (torch.zeros(3), "weights", 3):
        with pytest.raises(ValueError, match="state dict"):
            trainer.send(bad, version=1)
    with pytest.raises(ValueError, match="mapping"):
        rollout.receive(into=[("a", torch.zeros(1))], version=1)


@pytest.mark.timeout(180)
def test_quickstart_runs_as_is():
    """The README's quick start: ``python examples/quickstart.py`` with no environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")],
                          capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trainer: version 1: 4 tensors" in proc.stdout, proc.stdout
    assert "rollout: version 1: 4 tensors" in proc.stdout, proc.stdout
    assert "the rollout holds the trainer's weights" in proc.stdout
    assert len((ROOT / "examples" / "quickstart.py").read_text().splitlines()) <= 45
