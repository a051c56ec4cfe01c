"""Manager-level fault injection on a real local Ray cluster (CPU): rollout actor processes
killed mid-sync (each multi-process CPU backend), a replica dead before the sync, a
trainer rank killed mid-sync. One cluster per module; 2 FSDP2 trainer ranks on gloo."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("transformers")

import weightsync  # noqa: E402
from faultworkers import FaultyRollout, FaultyTrainer, trainer_group  # noqa: E402
from syncchecks import assert_matches, multiprocess_cpu_backends, on_all  # noqa: E402
from weightsync.core.errors import WeightSyncError  # noqa: E402
from weightsync.orchestration.manager import CheckpointEngineManager  # noqa: E402
from weightsync.integrations.ray.cluster import kill_actors, start_local_ray, stop_local_ray  # noqa: E402
from weightsync.integrations.ray.workers import HFRolloutWorker, ToyTrainerWorker  # noqa: E402
from weightsync.testing.toymodel import random_prompts, tiny_qwen2_config  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]
CFG = tiny_qwen2_config(vocab_size=1001, hidden_size=64, intermediate_size=128)
PROMPTS = random_prompts(2, 6, vocab_size=1001)
T = 8.0            # engine timeout: a dead peer is noticed within it


BACKENDS = multiprocess_cpu_backends()
assert {"shm", "collective"} <= set(BACKENDS), BACKENDS


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray

    paths = [str(Path(weightsync.__file__).resolve().parents[1]), str(Path(__file__).parent)]
    start_local_ray(num_cpus=2, temp_dir=str(tmp_path_factory.mktemp("ray")),
                    env={"PYTHONPATH": os.pathsep.join(paths)})
    classes = {"rollout": ray.remote(num_cpus=0, max_concurrency=4)(HFRolloutWorker),
               "faulty": ray.remote(num_cpus=0, max_concurrency=4)(FaultyRollout),
               "trainer": ray.remote(num_cpus=0)(ToyTrainerWorker),
               "faulty_trainer": ray.remote(num_cpus=0)(FaultyTrainer)}
    trainers = trainer_group(classes["trainer"], 2, CFG, timeout=60)
    replicas = [classes["rollout"].remote(CFG, seed=100 + i, name=f"hf-{i}") for i in range(2)]
    on_all(replicas, "ws_version")
    yield classes, trainers, replicas
    kill_actors(trainers + replicas)
    stop_local_ray()


def faulty(classes, seed=7):
    actor = classes["faulty"].remote(CFG, seed=seed, name="faulty")
    on_all([actor], "ws_version")
    return actor


def step(manager, trainers, version):
    on_all(trainers, "train_step", version)
    start = time.monotonic()
    report = manager.update_weights(version)
    took = time.monotonic() - start
    return report, on_all(trainers, "reference", PROMPTS, 5)[0], took


def check(manager, handles, ref, version):
    for h in handles:
        assert_matches(on_all([h], "generate", PROMPTS, max_new_tokens=5, return_logits=True)[0],
                       ref, version, who=manager.name_of(h))


def bound(manager):
    """A dead peer is noticed within T, the others get `settle`, then one rebuild + re-run."""
    return 2 * T + manager.settle + 40


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollout_process_killed_mid_sync(cluster, backend):
    classes, trainers, replicas = cluster
    victim = faulty(classes)
    group = replicas + [victim]
    with CheckpointEngineManager(backend, trainers, group, bucket_size=64 << 10,
                                 timeout=T) as manager:
        step(manager, trainers, 1)
        on_all([victim], "arm", "exit", 2)
        report, ref, took = step(manager, trainers, 2)
        print(f"\n{backend}: killed replica isolated, others synced in {took:.1f}s")
        assert took < bound(manager), took
        # nixl: the survivors finish their one-sided pulls of this version, so no re-run
        assert report.isolated == ["replica-2"] and report.retries == (0 if backend == "nixl" else 1)
        (failed,) = report.failed
        assert failed.name == "replica-2" and "died" in failed.error, failed.error
        assert report.completed == ["replica-0", "replica-1"]
        check(manager, replicas, ref, 2)
        assert [manager.name_of(h) for h in manager.healthy_replicas()] == ["replica-0",
                                                                            "replica-1"]
        replacement = faulty(classes, seed=8)
        assert manager.add_replica(replacement) == "replica-3"
        report, ref, _ = step(manager, trainers, 3)
        assert report.ok and report.rebuilt
        check(manager, replicas + [replacement], ref, 3)
        verified = manager.verify()
        assert verified.ok and sorted(verified.replicas) == ["replica-0", "replica-1",
                                                             "replica-3"]
    kill_actors([victim, replacement])


def test_replica_failing_in_its_own_name_after_the_bytes_is_isolated(cluster):
    """Every byte arrived (the trainers succeed), then the replica's own post-load step
    fails naming the replica its own way (``peer=`` its adapter's name, as the vLLM
    replica does): that is its own failure, isolated; the others keep the version."""
    classes, trainers, replicas = cluster
    victim = faulty(classes)
    with CheckpointEngineManager("shm", trainers, replicas + [victim], bucket_size=64 << 10,
                                 timeout=T) as manager:
        step(manager, trainers, 1)
        on_all([victim], "arm", "raise-named", 2)
        report, ref, took = step(manager, trainers, 2)
        assert report.isolated == ["replica-2"], report.summary()
        assert "after loading" in report.failed[0].error
        assert report.completed == ["replica-0", "replica-1"]
        check(manager, replicas, ref, 2)
        assert took < T, took        # no wait for a timeout: the evidence was there
    kill_actors([victim])


def test_replica_dead_before_the_sync(cluster):
    classes, trainers, replicas = cluster
    victim = faulty(classes)
    with CheckpointEngineManager("shm", trainers, replicas + [victim], bucket_size=64 << 10,
                                 timeout=T) as manager:
        step(manager, trainers, 1)
        kill_actors([victim])
        report, ref, took = step(manager, trainers, 2)
        assert report.isolated == ["replica-2"] and "died" in report.failed[0].error
        assert report.retries == 0 and report.completed == ["replica-0", "replica-1"]
        check(manager, replicas, ref, 2)
        assert took < bound(manager)


def test_trainer_rank_killed_mid_sync_then_restart(cluster):
    classes, trainers, replicas = cluster
    doomed = trainer_group(classes["faulty_trainer"], 2, CFG, timeout=30)
    manager = CheckpointEngineManager("shm", doomed, replicas, bucket_size=64 << 10, timeout=T)
    try:
        step(manager, doomed, 1)
        on_all(doomed[:1], "arm_exit", 2)
        on_all(doomed, "train_step", 2)
        start = time.monotonic()
        with pytest.raises(WeightSyncError) as info:
            manager.update_weights(2)
        took = time.monotonic() - start
        print(f"\nkilled trainer rank: {type(info.value).__name__} after {took:.1f}s")
        assert took < bound(manager)
        err = info.value
        assert err.peer == "trainer rank 0" and "died" in str(err), err
        assert not err.report.ok and not err.report.isolated     # no replica is blamed
        assert manager.healthy_replicas() == []                  # fenced until a resync
        with pytest.raises(Exception, match="refuses"):
            on_all(replicas[:1], "generate", PROMPTS, max_new_tokens=2)
        kill_actors(doomed)
        fresh = trainer_group(classes["trainer"], 2, CFG, timeout=60, seed=5)
        manager.set_trainers(fresh)
        report, ref, _ = step(manager, fresh, 3)
        assert report.ok and report.rebuilt
        check(manager, replicas, ref, 3)
        assert manager.verify().ok and len(manager.healthy_replicas()) == 2
        kill_actors(fresh)
    finally:
        manager.shutdown()
        kill_actors(doomed)
