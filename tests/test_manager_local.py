"""CheckpointEngineManager with workers in this process (no Ray): inproc e2e, LoRA,
validation errors, and a negative control showing the checks catch stale weights."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from syncchecks import assert_changed, assert_matches  # noqa: E402
from weightsync.engines import CheckpointEngineRegistry  # noqa: E402
from weightsync.engines.inproc import InprocEngine  # noqa: E402
from weightsync.errors import TopologyError  # noqa: E402
from weightsync.manager import CheckpointEngineManager  # noqa: E402
from weightsync.ray.workers import HFRolloutWorker, ToyTrainerWorker  # noqa: E402
from weightsync.toymodel import lora_config, random_prompts, tiny_qwen2_config  # noqa: E402

pytestmark = pytest.mark.timeout(240)
CFG = tiny_qwen2_config(vocab_size=1001, hidden_size=64, intermediate_size=128)
PROMPTS = random_prompts(2, 6, vocab_size=1001)


def _gen(worker):
    return worker.generate(PROMPTS, max_new_tokens=5, return_logits=True)


def _trainer(lora=None, lr=0.05):
    t = ToyTrainerWorker()
    t.build(CFG, lora=lora, lr=lr)
    return t


def _run_steps(manager, trainer, replicas, steps=3, merge=True, lora_mode="merged"):
    prev = None
    for step in range(1, steps + 1):
        trainer.train_step(step)
        report = manager.update_weights(step, merge_and_sync=merge)
        assert report.ok and report.bytes > 0 and report.version == step
        ref = trainer.reference(PROMPTS, 5, lora_mode=lora_mode)
        assert_changed(ref, prev)
        for r in replicas:
            assert_matches(_gen(r), ref, step)
        prev = ref
    return report


def test_inproc_end_to_end_three_steps():
    trainer = _trainer()
    replicas = [HFRolloutWorker(CFG, seed=5 + i) for i in range(2)]
    with CheckpointEngineManager("inproc", [trainer], replicas, bucket_size=1 << 20,
                                 timeout=30) as manager:
        report = _run_steps(manager, trainer, replicas)
        assert report.phases == ["pause", "sync:full", "reset_caches", "resume"]
        assert [r.version for r in report.replicas] == [3, 3]


class StaleWorker(HFRolloutWorker):
    """Negative control: receives every sync but keeps its old weights."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        rollout = self.rollout

        async def drain(weights, *, version, kind, adapter_config):
            async for _ in weights:
                pass
            rollout._version = version
            return {}

        rollout.load_weights = drain


def test_checks_catch_a_replica_that_keeps_stale_weights():
    trainer = _trainer()
    replicas = [HFRolloutWorker(CFG, seed=5), StaleWorker(CFG, seed=6)]
    with CheckpointEngineManager("inproc", [trainer], replicas, bucket_size=1 << 20,
                                 timeout=30) as manager:
        with pytest.raises(AssertionError, match="tokens|logits"):
            _run_steps(manager, trainer, replicas, steps=1)


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "adapter-only"])
def test_lora_generations_equal_the_trainers_peft_model(merge):
    trainer = _trainer(lora=lora_config(), lr=0.5)
    replicas = [HFRolloutWorker(CFG, seed=5)]
    with CheckpointEngineManager("shm", [trainer], replicas, bucket_size=1 << 20,
                                 timeout=30) as manager:
        kinds = []
        for step in range(1, 4):
            trainer.train_step(step)
            report = manager.update_weights(step, merge_and_sync=merge)
            kinds.append("+".join(report.kinds))
            ref = trainer.reference(PROMPTS, 5, source="model")   # the PEFT model itself
            assert_matches(_gen(replicas[0]), ref, step, exact=not merge)
            assert replicas[0].rollout.has_adapter() == (not merge)
        assert kinds == (["full"] * 3 if merge else ["base+adapter", "adapter", "adapter"])
        assert manager.base_sync_done == (not merge)
        if not merge:   # adapter bytes only after the first sync
            assert report.bytes < 0.1 * sum(p.numel() * 4 for p in trainer.model.parameters())


class _BadTopology(InprocEngine):
    @classmethod
    def build_topology(cls, trainer_world_size, rollout_world_size, metadata):
        tk, rk = super().build_topology(trainer_world_size, rollout_world_size, metadata)
        rk["rank"] = rk["rank"][:-1]
        return tk, rk


def test_topology_validation_names_backend_key_and_sizes():
    CheckpointEngineRegistry.register("test_bad_topology")(_BadTopology)
    trainer = _trainer()
    replicas = [HFRolloutWorker(CFG, seed=5 + i) for i in range(2)]
    manager = CheckpointEngineManager("test_bad_topology", [trainer], replicas,
                                      bucket_size=1 << 20, timeout=30)
    with pytest.raises(TopologyError) as info:
        manager.update_weights(1)
    msg = str(info.value)
    assert "test_bad_topology" in msg and "'rank'" in msg and "rollout" in msg
    assert "1" in msg and "2" in msg
    manager.shutdown()


def test_argument_validation():
    trainer, rep = object(), object()
    with pytest.raises(ValueError, match="unknown backend"):
        CheckpointEngineManager("nope", trainer, [rep])
    with pytest.raises(ValueError, match="sleep_level"):
        CheckpointEngineManager("inproc", trainer, [rep], sleep_level=3)
    with pytest.raises(ValueError, match="unknown engine option"):
        CheckpointEngineManager("inproc", trainer, [rep], bogus=1)
    with pytest.raises(ValueError, match="bucket_size"):
        CheckpointEngineManager("inproc", trainer, [rep], bucket_size=1000)
    manager = CheckpointEngineManager("inproc", trainer, [rep])
    with pytest.raises(ValueError, match="version"):
        manager.update_weights(1.5)
    with pytest.raises(ValueError, match="already managed"):
        manager.add_replica(rep)
