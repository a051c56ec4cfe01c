"""CheckpointEngineManager end to end on a real local Ray cluster (CPU): 2 FSDP2 trainer
ranks on gloo, 2 HF rollout replicas; one cluster and one set of actors per module."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("ray")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from syncchecks import (assert_changed, assert_matches, multiprocess_cpu_backends,  # noqa: E402
                        on_all)
from weightsync.orchestration.manager import CheckpointEngineManager  # noqa: E402
from weightsync.integrations.ray.cluster import (hf_replicas, kill_actors, start_local_ray,  # noqa: E402
                                    stop_local_ray, trainer_group)
from weightsync.testing.toymodel import lora_config, random_prompts, tiny_qwen2_config  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
CFG = tiny_qwen2_config(vocab_size=1001, hidden_size=64, intermediate_size=128)
PROMPTS = random_prompts(2, 6, vocab_size=1001)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    start_local_ray(num_cpus=2, temp_dir=str(tmp_path_factory.mktemp("ray")))
    trainers = trainer_group(2, CFG, fsdp=True)
    replicas = hf_replicas(2, CFG)
    yield trainers, replicas
    kill_actors(trainers + replicas)
    stop_local_ray()


def fresh(cluster, lora=None):
    trainers, replicas = cluster
    on_all(trainers, "build", CFG, fsdp=True, lora=lora, lr=0.5 if lora else 0.05)
    for i, r in enumerate(replicas):
        on_all([r], "reset", CFG, seed=100 + i)
    return trainers, replicas


def step_and_check(manager, trainers, replicas, step, *, merge=True, lora_mode="merged",
                   prev=None):
    on_all(trainers, "train_step", step)
    report = manager.update_weights(step, merge_and_sync=merge)
    assert report.ok and report.version == step and report.bytes > 0
    ref = on_all(trainers, "reference", PROMPTS, 5, lora_mode=lora_mode)[0]
    assert ref["trainer_max_abs_diff"] < 1e-4     # the reference is the FSDP2 model's output
    assert_changed(ref, prev)
    for r in replicas:
        assert_matches(on_all([r], "generate", PROMPTS, max_new_tokens=5,
                              return_logits=True)[0], ref, step, who=manager.name_of(r))
    return report, ref


@pytest.mark.parametrize("backend", multiprocess_cpu_backends())
def test_backend_end_to_end_fsdp2_to_hf(cluster, backend):
    trainers, replicas = fresh(cluster)
    with CheckpointEngineManager(backend, trainers, replicas, bucket_size=64 << 10,
                                 timeout=60) as manager:
        prev = None
        for step in (1, 2, 3):
            report, prev = step_and_check(manager, trainers, replicas, step, prev=prev)
            assert report.rebuilt == (step == 1)
            assert len(report.trainer) == 2 and all(m["bytes"] > 0 for m in report.trainer)
        assert on_all(replicas, "ws_version") == [3, 3]


@pytest.mark.parametrize("atomic", [False, True], ids=["live", "atomic"])
def test_shm_writes_straight_into_replicas_that_share_their_weights(cluster, atomic):
    """HF replicas with their weights in shared memory (``share_memory=True``): the
    trainers write every weight straight into them, live or into the staging copy of an
    atomic sync, and the replicas generate what the trainer does."""
    trainers, replicas = cluster
    on_all(trainers, "build", CFG, fsdp=True, lora=None, lr=0.05)
    for i, r in enumerate(replicas):
        on_all([r], "reset", CFG, seed=100 + i, share_memory=True)
    try:
        with CheckpointEngineManager("shm", trainers, replicas, bucket_size=64 << 10,
                                     timeout=60, atomic=atomic) as manager:
            prev = None
            for step in (1, 2, 3):
                report, prev = step_and_check(manager, trainers, replicas, step, prev=prev)
                pushed = sum(m.get("pushed", 0) for m in report.trainer)
                assert pushed == len(on_all(trainers, "ws_describe")[0]), pushed
    finally:
        for i, r in enumerate(replicas):
            on_all([r], "reset", CFG, seed=100 + i, share_memory=False)


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "adapter-only"])
def test_lora_fsdp2_trainer(cluster, merge):
    trainers, replicas = fresh(cluster, lora=lora_config())
    with CheckpointEngineManager("shm", trainers, replicas, bucket_size=64 << 10,
                                 timeout=60) as manager:
        prev, kinds = None, []
        for step in (1, 2, 3):
            report, prev = step_and_check(manager, trainers, replicas, step, merge=merge,
                                          lora_mode="merged" if merge else "adapter", prev=prev)
            kinds.append("+".join(report.kinds))
        assert kinds == (["full"] * 3 if merge else ["base+adapter", "adapter", "adapter"])


def _since_last_pause(log):
    start = max(i for i, x in enumerate(log) if x == "pause")
    return log[start:]


def test_colocated_order_level_cap_and_no_weights_lost(cluster):
    trainers, replicas = fresh(cluster, lora=lora_config())
    with CheckpointEngineManager("shm", trainers, replicas, colocated=True, sleep_level=2,
                                 offload_trainer=True, bucket_size=64 << 10,
                                 timeout=60) as manager:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)   # step 1 restores all: no cap
            report, prev = step_and_check(manager, trainers, replicas, 1, merge=False,
                                          lora_mode="adapter")
        assert report.sleep_level == 2
        for log in on_all(replicas, "ws_call_log"):
            assert _since_last_pause(log) == [
                "pause", "sleep:2", "wake_up:weights", "load:base:1", "load:adapter:1",
                "wake_up:kv_cache", "reset_caches", "resume"]
        with pytest.warns(RuntimeWarning, match="capped at 1"):
            report, _ = step_and_check(manager, trainers, replicas, 2, merge=False,
                                       lora_mode="adapter", prev=prev)
        assert report.sleep_level == 1 and report.kinds == ["adapter"]
        assert report.phases == ["pause", "sleep:1", "trainer_offload", "wake_up:weights",
                                 "sync:adapter", "trainer_reload", "wake_up:kv_cache",
                                 "reset_caches", "resume"]
        for log in on_all(replicas, "ws_call_log"):
            assert _since_last_pause(log) == [
                "pause", "sleep:1", "wake_up:weights", "load:adapter:2", "wake_up:kv_cache",
                "reset_caches", "resume"]
        trainer_log = on_all(trainers, "call_log")
        assert all(log[-3:] == ["train:2", "offload", "reload"] for log in trainer_log)


def test_add_and_remove_replica_then_sync(cluster):
    trainers, replicas = fresh(cluster)
    first, second = replicas
    with CheckpointEngineManager("shm", trainers, [first], bucket_size=64 << 10,
                                 timeout=60) as manager:
        _, prev = step_and_check(manager, trainers, [first], 1)
        name = manager.add_replica(second)
        assert name == "replica-1"
        report, prev = step_and_check(manager, trainers, [first, second], 2, prev=prev)
        assert report.rebuilt and [r.name for r in report.replicas] == ["replica-0", "replica-1"]
        manager.remove_replica(first)
        report, _ = step_and_check(manager, trainers, [second], 3, prev=prev)
        assert report.rebuilt and [r.name for r in report.replicas] == ["replica-1"]
        assert on_all([first, second], "ws_version") == [2, 3]


def test_delta_option_through_the_manager(cluster):
    """``delta=True`` on the manager puts the codec over its backend (``delta+shm``): the
    first sync and the one that re-adds a replica go dense, the others send only the
    changed bf16 elements; ``verify()`` is exact after every sync."""
    import torch

    trainers, replicas = cluster
    on_all(trainers, "build", CFG, fsdp=True, lr=1e-5)
    for i, r in enumerate(replicas):
        on_all([r], "reset", CFG, seed=100 + i)
    first, second = replicas
    with CheckpointEngineManager("shm", trainers, replicas, bucket_size=64 << 10, timeout=60,
                                 delta=True, dtype=torch.bfloat16) as manager:
        assert manager.backend == "delta+shm" and manager.codec.delta is True
        modes, sent = [], []
        for step in (1, 2, 3, 4, 5, 6):
            if step == 4:
                manager.remove_replica(second)
            if step == 5:
                manager.add_replica(second)       # holds version 3's base: dense again
            on_all(trainers, "train_step", step)
            report = manager.update_weights(step)
            assert report.ok, report.summary()
            modes.append({t["codec"]["mode"] for t in report.trainer})
            sent.append(sum(t["bytes"] for t in report.trainer))
            check = manager.verify()
            assert check.ok, check.replicas
        # step 4: the group is rebuilt without a replica, the engines keep their bases
        assert modes == [{"dense"}, {"delta"}, {"delta"}, {"delta"}, {"dense"}, {"delta"}], modes
        # bf16 at lr 1e-5: a few % of the elements change per step
        assert max(sent[1], sent[2], sent[5]) < 0.5 * sent[0], sent
        assert on_all(replicas, "ws_version") == [6, 6]


def test_fp8_option_is_checked_against_the_replicas_before_bytes(cluster):
    """``quantize="fp8-block"``: the trainer's set is described as the replicas would get
    it (FP8 weights + ``weight_scale_inv``); HF replicas of a bf16 model hold no scales,
    so the sync is refused before anything moves, naming the tensors."""
    from weightsync.core.errors import PlanMismatch

    trainers, replicas = fresh(cluster)
    with CheckpointEngineManager("shm", trainers, replicas, bucket_size=64 << 10, timeout=60,
                                 quantize="fp8-block") as manager:
        assert manager.backend == "fp8+shm" and manager.codec.quantize == "fp8-block"
        on_all(trainers, "train_step", 1)
        with pytest.raises(PlanMismatch, match="weight_scale_inv") as err:
            manager.update_weights(1)
        assert err.value.phase == "validate"
        assert on_all(replicas, "ws_version") == [None, None]      # no byte moved
