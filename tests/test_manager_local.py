"""CheckpointEngineManager with workers in this process (no Ray): inproc e2e, LoRA,
validation errors, and a negative control showing the checks catch stale weights."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from syncchecks import assert_changed, assert_matches  # noqa: E402
from weightsync.transport import CheckpointEngineRegistry  # noqa: E402
from weightsync.transport.backends.inproc import InprocEngine  # noqa: E402
from weightsync.core.errors import TopologyError, WeightSyncError  # noqa: E402
from weightsync.orchestration.manager import CheckpointEngineManager  # noqa: E402
from weightsync.integrations.ray.workers import HFRolloutWorker, ToyTrainerWorker  # noqa: E402
from weightsync.testing.toymodel import lora_config, random_prompts, tiny_qwen2_config  # noqa: E402

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


def test_backend_options_reach_every_workers_engine(monkeypatch):
    """A backend's own options (keywords or ``options=``) go through the manager."""
    from weightsync import ShmOptions
    from weightsync.transport.backends.shm.engine import ShmEngine
    seen = []
    prepare = ShmEngine.prepare

    def spy(self):
        seen.append(self.options)
        return prepare(self)

    monkeypatch.setattr(ShmEngine, "prepare", spy)
    trainer = _trainer()
    replicas = [HFRolloutWorker(CFG, seed=5)]
    with pytest.raises(ValueError, match="direct"):
        CheckpointEngineManager("shm", [trainer], replicas, direct="sometimes")
    with pytest.raises(ValueError, match="unknown engine option.*zero_copy"):
        CheckpointEngineManager("shm", [trainer], replicas, zero_copy=True)
    with CheckpointEngineManager("shm", [trainer], replicas, bucket_size=1 << 20, timeout=30,
                                 options=ShmOptions(direct=False, copy_threads=1)) as manager:
        _run_steps(manager, trainer, replicas, steps=1)
    assert len(seen) >= 2 and all(o.direct is False and o.copy_threads == 1 for o in seen)
    seen.clear()
    trainer, replicas = _trainer(), [HFRolloutWorker(CFG, seed=5)]
    with CheckpointEngineManager("delta+shm", [trainer], replicas, bucket_size=1 << 20,
                                 timeout=30, direct=False) as manager:
        _run_steps(manager, trainer, replicas, steps=2)
    assert len(seen) >= 2 and all(o.direct is False for o in seen)


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


def test_argument_validation(monkeypatch):
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
    monkeypatch.setenv("WEIGHTSYNC_TIMEOUT", "12.5")
    monkeypatch.setenv("WEIGHTSYNC_BUCKET_SIZE", str(1 << 20))
    manager = CheckpointEngineManager("inproc", trainer, [rep])
    assert manager.timeout == 12.5 and manager.engine_kwargs["bucket_size"] == 1 << 20
    assert CheckpointEngineManager("inproc", trainer, [rep], timeout=3).timeout == 3.0


class FlakyWorker(HFRolloutWorker):
    """Fails in the middle of its first receive, then behaves."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.failures_left = 1
        rollout, original = self.rollout, self.rollout.load_weights

        async def broken(weights):
            count = 0
            async for item in weights:
                count += 1
                if count == 3:
                    raise RuntimeError("injected failure while loading")
                yield item

        async def load(weights, **kw):
            if self.failures_left:
                self.failures_left -= 1
                weights = broken(weights)       # the first tensors are applied, then it fails
            return await original(weights, **kw)

        rollout.load_weights = load


def test_failed_sync_reports_the_replica_and_the_next_sync_recovers():
    trainer = _trainer()
    replicas = [HFRolloutWorker(CFG, seed=5), FlakyWorker(CFG, seed=6)]
    with CheckpointEngineManager("shm", [trainer], replicas, bucket_size=64 << 10,
                                 timeout=20, isolate_failures=False) as manager:
        trainer.train_step(1)
        with pytest.raises(WeightSyncError) as info:
            manager.update_weights(1)
        assert info.value.peer == "replica-1"          # the root cause, not a relay
        report = info.value.report
        assert not report.ok and "replica-1" in [r.name for r in report.failed]
        assert "injected failure" in report.replicas[1].error
        with pytest.raises(WeightSyncError, match="refuses"):
            replicas[1].generate(PROMPTS, max_new_tokens=2)     # fenced, not half-updated
        report = _run_steps(manager, trainer, replicas, steps=1)
        assert report.rebuilt and report.ok


def test_keep_group_false_rebuilds_every_sync_and_execute_checkpoint_engine():
    trainer = _trainer()
    replicas = [HFRolloutWorker(CFG, seed=5)]
    with CheckpointEngineManager("shm", [trainer], replicas, bucket_size=64 << 10, timeout=20,
                                 keep_group=False) as manager:
        trainer.train_step(1)
        r1 = manager.update_weights(1)
        assert r1.rebuilt and "finalize" in r1.phases
        with pytest.raises(RuntimeError, match="ws_prepare first"):
            trainer.execute_checkpoint_engine("reset_plan")
        trainer.train_step(2)
        r2 = manager.update_weights(2)
        assert r2.rebuilt and replicas[0].ws_version() == 2
    with CheckpointEngineManager("shm", [trainer], replicas, bucket_size=64 << 10,
                                 timeout=20) as manager:
        manager.update_weights(3)
        assert trainer.execute_checkpoint_engine("reset_plan") is None
        assert replicas[0].execute_checkpoint_engine("reset_plan") is None
        with pytest.raises(ValueError, match="no public method"):
            replicas[0].execute_checkpoint_engine("_release")
        manager.update_weights(4)      # layouts re-sent after the reset
        assert_matches(_gen(replicas[0]), trainer.reference(PROMPTS, 5), 4)


def test_validation_is_cached_by_weight_set_and_redone_when_needed():
    """A replica that accepted a weight set is not asked again for the same set; a
    changed set (LoRA's adapter round), revalidate() and a stale replica are checked
    again."""
    trainer = _trainer()
    replicas = [HFRolloutWorker(CFG, seed=5 + i) for i in range(2)]
    counts = [0, 0]
    for i, r in enumerate(replicas):
        real = r.rollout.check_weights

        def counted(*a, _i=i, _real=real, **kw):
            counts[_i] += 1
            return _real(*a, **kw)
        r.rollout.check_weights = counted
    with CheckpointEngineManager("inproc", [trainer], replicas, bucket_size=1 << 20,
                                 timeout=30) as manager:
        def step(v):
            trainer.train_step(v)
            report = manager.update_weights(v)
            assert report.ok
            return report.validated
        assert step(1) == ["replica-0", "replica-1"] and counts == [1, 1]
        assert step(2) == [] and counts == [1, 1]        # the same set: not asked again
        manager.revalidate()
        assert step(3) == ["replica-0", "replica-1"] and counts == [2, 2]
        manager._replicas.mark_stale(manager._replicas.managed()[1])
        assert step(4) == ["replica-1"] and counts == [2, 3]
        for r in replicas:
            assert_matches(_gen(r), trainer.reference(PROMPTS, 5), 4)
