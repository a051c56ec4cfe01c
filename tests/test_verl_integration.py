"""weightsync as verl checkpoint engines, driven by verl's real CheckpointEngineManager.

One Ray cluster for the module (2 trainer ranks with FSDP2-sharded weights on gloo, 2
replicas x 2 rollout ranks, all CPU); every update is checked bit-exact on every rollout
rank. The unit tests at the top need verl but no Ray cluster.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed (make verl)")
pytest.importorskip("ray")

import torch  # noqa: E402
from verl.checkpoint_engine import CheckpointEngineRegistry as VerlRegistry  # noqa: E402

import weightsync.integrations.verl as wv  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

STEPS = (0, 1, 1, None, 2)
KW = {"timeout": 60.0}


# -- without a cluster ----------------------------------------------------------------------

def test_registers_weightsync_backends_in_verls_registry():
    names = wv.registered_backends()
    assert {"weightsync-shm", "weightsync-collective"} <= set(names)
    assert "weightsync-inproc" not in names   # trainer and rollout are separate actors in verl
    assert VerlRegistry.get("weightsync-shm").weightsync_backend == "shm"
    # verl spells its own names with dashes; both spellings reach the same backend
    assert VerlRegistry.get("weightsync-cuda-ipc") is VerlRegistry.get("weightsync-cuda_ipc")
    assert VerlRegistry.get("weightsync-cuda-ipc").weightsync_backend == "cuda_ipc"


def test_import_without_verl_names_the_fix():
    code = "import sys; sys.modules['verl'] = None; import weightsync.integrations.verl"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and "needs verl" in proc.stderr
    assert "pip install --no-deps verl==0.9.1" in proc.stderr


def test_verl_call_shape_and_validation():
    trainer = VerlRegistry.new("weightsync-shm", is_master=True, bucket_size=1 << 20, **KW)
    rollout = VerlRegistry.new("weightsync-shm", bucket_size=1 << 20, **KW)
    try:
        assert (trainer.role, trainer.engine.config.role) == ("trainer", "trainer")
        assert (rollout.role, rollout.engine.config.role) == ("rollout", "rollout")
        assert trainer.prepare() == trainer.prepare()   # stable while nothing changed
    finally:
        trainer.close()
        rollout.close()
    with pytest.raises(ValueError, match="role"):
        VerlRegistry.new("weightsync-shm", bucket_size=1 << 20, role="trainer")
    with pytest.raises(ValueError, match="unknown option"):
        VerlRegistry.new("weightsync-shm", bucket_size=1 << 20, bukcet=1)
    with pytest.raises(ValueError, match="reuse"):
        VerlRegistry.new("weightsync-shm", bucket_size=1 << 20, reuse="yes")
    with pytest.raises(ValueError, match="bucket_size"):
        VerlRegistry.new("weightsync-shm", bucket_size=1000)


def test_host_auto_as_a_keyword_or_the_variable_is_this_nodes_ip(monkeypatch):
    monkeypatch.setattr(wv, "_node_ip", lambda: "127.0.0.1")   # what Ray would say
    monkeypatch.setenv("WEIGHTSYNC_HOST", "auto")
    for kw in ({}, {"host": "auto"}):
        engine = VerlRegistry.new("weightsync-shm", bucket_size=1 << 20, **KW, **kw)
        try:
            assert engine.engine.config.host == "127.0.0.1"
        finally:
            engine.close()


def _meta(i: int, group=None) -> dict:
    return {"role": "trainer" if i < 1 else "rollout", "hostname": "h", "pid": i,
            "host": "127.0.0.1", "port": 1000 + i, "auth": "a" * 32, "backend": "shm",
            "verl_session": f"s{i}", "verl_group": group}


def test_group_token_is_reused_only_when_every_worker_holds_it():
    metas = [_meta(i) for i in range(3)]
    first = wv.group_token("shm", 1, 2, metas)
    assert first == wv.group_token("shm", 1, 2, [dict(m) for m in metas])   # deterministic
    joined = [_meta(i, first) for i in range(3)]
    assert wv.group_token("shm", 1, 2, joined) == first                    # unchanged: reuse
    # A -> B -> A: a worker still parked in the first group must not look joined.
    aba = [_meta(0, "x" * 32), _meta(1, "x" * 32), _meta(2, first)]
    assert wv.group_token("shm", 1, 2, aba) not in (first, "x" * 32)
    # Same groups, other metadata (a restarted worker): a new token.
    moved = joined[:2] + [dict(joined[2], verl_session="s9")]
    assert wv.group_token("shm", 1, 2, moved) != first


# -- through verl's manager over Ray ------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    from harness_verl import VerlCluster, ce_config
    c = VerlCluster(ce_config("weightsync-shm", 1, **KW))
    c.fresh_ce = c.ce   # engines built by verl's own constructors, not used yet
    yield c
    c.shutdown()


def _use(cluster, backend: str, **kwargs):
    from harness_verl import ce_config
    ce = ce_config(backend, 1, **KW, **kwargs)
    if getattr(cluster, "fresh_ce", None) != ce:
        cluster.use_backend(ce)
    cluster.fresh_ce = None
    return ce


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _check(cluster, step, ranks=None) -> None:
    from harness_verl import expected_weights
    want = expected_weights(step)
    for rank, (steps, _, items) in enumerate(cluster.received()):
        if ranks is not None and rank not in ranks:
            continue
        assert steps == step, f"rollout rank {rank} got global_steps {steps!r}, not {step!r}"
        names = [n for n, _ in items]
        assert sorted(names) == sorted(want), f"rollout rank {rank}: {sorted(names)}"
        for name, tensor in items:
            exp = want[name]
            assert (tensor.dtype, tuple(tensor.shape)) == (exp.dtype, tuple(exp.shape)), name
            assert _bits(tensor) == _bits(exp), f"rollout rank {rank}: {name} differs"


def _stats(cluster) -> list[dict]:
    return cluster.cycle_stats()


@pytest.mark.parametrize("backend", ["weightsync-shm", "weightsync-collective"])
def test_manager_updates_are_bit_exact_and_reuse_the_group(cluster, backend):
    _use(cluster, backend)
    for i, step in enumerate(STEPS):
        metrics = cluster.update(step)
        _check(cluster, step)
        assert metrics["weightsync/bytes"] > 0
        assert metrics["weightsync/group_reused"] == (0.0 if i == 0 else 1.0)
    stats = _stats(cluster)
    assert [s["role"] for s in stats] == ["trainer"] * 2 + ["rollout"] * 4
    for s in stats:   # joined once, then every later update reused the group
        assert (s["joins"], s["reuses"], s["releases"]) == (1, len(STEPS) - 1, 0), s


def test_replica_removed_and_added_back_rejoins(cluster):
    _use(cluster, "weightsync-shm")
    cluster.update(7)
    spare = cluster.replicas[1]
    cluster.manager.remove_replicas([spare])
    cluster.update(8)
    _check(cluster, 8, ranks={0, 1})
    assert [r[0] for r in cluster.received()[2:]] == [7, 7]   # the removed replica kept 7
    cluster.manager.add_replicas([spare])
    cluster.update(9)
    _check(cluster, 9)
    cluster.update(10)   # unchanged again: reused
    _check(cluster, 10)
    joins = [s["joins"] for s in _stats(cluster)]
    assert joins == [3, 3, 3, 3, 2, 2], joins   # replica 1 sat out the middle topology


def test_failed_update_is_reported_and_the_next_one_recovers(cluster):
    _use(cluster, "weightsync-shm")
    cluster.update(1)
    cluster.rollout_wg.fail_next_update(3, 2)   # rollout rank 3 fails after 2 tensors
    start = time.monotonic()
    with pytest.raises(Exception, match="injected adapter failure|PeerFailed|failed"):
        cluster.update(2)
    assert time.monotonic() - start < 60
    deadline = time.monotonic() + 60
    while any(s["in_flight"] for s in _stats(cluster)):   # let the failed sync unwind
        assert time.monotonic() < deadline, _stats(cluster)
        time.sleep(0.2)
    metrics = cluster.update(3)
    _check(cluster, 3)
    assert metrics["weightsync/group_reused"] == 0.0
    assert all(s["joins"] == 2 and s["releases"] >= 1 for s in _stats(cluster))


def test_reuse_off_releases_every_update(cluster):
    _use(cluster, "weightsync-collective", reuse=False)
    for step in (4, 5):
        metrics = cluster.update(step)
        _check(cluster, step)
        assert metrics["weightsync/group_reused"] == 0.0
    assert all((s["joins"], s["reuses"], s["releases"]) == (2, 0, 2) for s in _stats(cluster))
