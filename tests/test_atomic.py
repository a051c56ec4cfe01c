"""Atomic syncs (``CheckpointEngineManager(atomic=True)``) with workers in this process (shm
between threads): a failure injected at every phase of a sync leaves every replica
serving its previous version (bit for bit against the trainer's reference), unfenced and
healthy, and the next sync succeeds; the staged HF apply, its memory cost, the refusals
(replicas without a separate commit such as vLLM, adapter syncs) and the one window after
the decision (release, resume)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("transformers")

from faultworkers import FaultyRollout  # noqa: E402
from syncchecks import assert_matches  # noqa: E402
from weightsync.core.errors import SyncTimeout, WeightSyncError  # noqa: E402
from weightsync.orchestration.manager import CheckpointEngineManager  # noqa: E402
from weightsync.integrations.ray.workers import HFRolloutWorker, ToyTrainerWorker  # noqa: E402
from weightsync.testing.toymodel import lora_config, random_prompts, tiny_qwen2_config  # noqa: E402

pytestmark = pytest.mark.timeout(240)
CFG = tiny_qwen2_config(vocab_size=1001, hidden_size=64, intermediate_size=128)
PROMPTS = random_prompts(2, 6, vocab_size=1001)
T = 5.0
HOOKED = ("check_weights", "pause", "begin_sync", "sleep", "wake_up", "commit",
          "reset_caches", "release", "resume")


class PhaseFault(FaultyRollout):
    """:class:`FaultyRollout` (faults inside a receive) plus ``fail(method, when, tag)``:
    the next call of ``ws_<method>`` (whose first argument contains ``tag``, if given)
    raises, doing nothing (``"before"``) or after doing its work (``"after"``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fail: dict = {}

    def fail(self, method, when="before", tag=None):
        self._fail[method] = (when, tag)

    def _hooked(self, method, fn, *args, **kwargs):
        when, tag = self._fail.get(method, (None, None))
        if when is None or (tag is not None and tag not in (args[0] if args else ())):
            return fn(*args, **kwargs)
        del self._fail[method]
        if when == "after":
            fn(*args, **kwargs)
        raise RuntimeError(f"injected failure in ws_{method} ({when})")


def _hook(method):
    def call(self, *args, **kwargs):
        return self._hooked(method, getattr(super(PhaseFault, self), f"ws_{method}"),
                            *args, **kwargs)
    return call


for _m in HOOKED:
    setattr(PhaseFault, f"ws_{_m}", _hook(_m))


class FaultTrainer(ToyTrainerWorker):
    """``fail_describe``: the next ``ws_describe`` raises; ``fail_send``: the next send
    raises after 3 tensors of its export."""

    fail_describe = fail_send = False

    def ws_describe(self, *args, **kwargs):
        if self.fail_describe:
            self.fail_describe = False
            raise RuntimeError("injected failure in ws_describe")
        return super().ws_describe(*args, **kwargs)

    def ws_prepare(self, backend, engine_kwargs):
        meta = super().ws_prepare(backend, engine_kwargs)
        engine = self._ws().engine
        original = engine.send_weights

        async def send(named, version=None):
            if self.fail_send:
                self.fail_send = False
                named = _failing(named)
            return await original(named, version=version)

        engine.send_weights = send
        return meta


def _failing(named):
    for i, item in enumerate(named):
        if i == 3:
            raise RuntimeError("injected failure in the trainer's export")
        yield item


def _setup(**kw):
    trainer = FaultTrainer()
    trainer.build(CFG)
    replicas = [HFRolloutWorker(CFG, seed=5), PhaseFault(CFG, seed=6)]
    kw.setdefault("timeout", T)
    kw.setdefault("atomic", True)
    manager = CheckpointEngineManager("shm", [trainer], replicas, bucket_size=64 << 10, **kw)
    return trainer, replicas, manager


def _gen(worker, **kw):
    return worker.generate(PROMPTS, max_new_tokens=5, return_logits=True, **kw)


def _step(manager, trainer, step, **kw):
    trainer.train_step(step)
    report = manager.update_weights(step, **kw)
    return report, trainer.reference(PROMPTS, 5)


def _all_serve(manager, replicas, ref, version):
    for r in replicas:
        assert_matches(_gen(r), ref, version)
    assert_matches(manager.generate(PROMPTS, max_new_tokens=5, return_logits=True), ref,
                   version)


# phase -> (colocated, how to inject the failure on the trainer / on replica-1)
BEFORE_DECISION = {
    "validate": (False, lambda t, f: f.fail("check_weights")),
    "validate:trainer": (False, lambda t, f: setattr(t, "fail_describe", True)),
    "pause": (False, lambda t, f: f.fail("pause", "after")),
    "begin_sync": (False, lambda t, f: f.fail("begin_sync", "after")),
    "sleep": (True, lambda t, f: f.fail("sleep", "after")),
    "wake_up:weights": (True, lambda t, f: f.fail("wake_up", "before", "weights")),
    "transfer:trainer": (False, lambda t, f: setattr(t, "fail_send", True)),
    "transfer:replica": (False, lambda t, f: f.arm("raise", version=2)),
    "wake_up:kv_cache": (True, lambda t, f: f.fail("wake_up", "before", "kv_cache")),
    "commit": (False, lambda t, f: f.fail("commit", "before")),
    "commit:after": (False, lambda t, f: f.fail("commit", "after")),
    "reset_caches": (False, lambda t, f: f.fail("reset_caches", "after")),
}


@pytest.mark.parametrize("phase", list(BEFORE_DECISION))
def test_a_failure_before_the_decision_leaves_every_replica_on_its_previous_version(phase):
    colocated, arm = BEFORE_DECISION[phase]
    trainer, replicas, manager = _setup(colocated=colocated)
    with manager:
        _, ref1 = _step(manager, trainer, 1)
        _all_serve(manager, replicas, ref1, 1)
        trainer.train_step(2)
        arm(trainer, replicas[1])
        if phase == "validate":   # the replicas accepted this weight set at sync 1: they
            manager.revalidate()  # are asked again only when told to (or it changes)
        with pytest.raises(WeightSyncError, match="injected failure") as info:
            manager.update_weights(2)
        report = info.value.report
        assert report.atomic and report.phases[-2:] == ["abort", "resume"], report.phases
        assert report.kept == {"replica-0": 1, "replica-1": 1}, report.replicas
        assert not any(st.committed or st.isolated for st in report.replicas)
        assert not report.isolated and not manager.failed_replicas()
        assert [(h["state"], h["version"]) for h in manager.replica_health()] == \
            [("healthy", 1)] * 2
        assert manager.healthy_replicas() == replicas          # not fenced as stale
        for r in replicas:
            assert r.rollout._staging is None and r.rollout.current_version() == 1
            assert r.rollout.sync_state()["fenced"] is None
        _all_serve(manager, replicas, ref1, 1)                  # the previous version
        rolled = [st.rolled_back for st in report.replicas]
        if phase.startswith("commit") or phase == "reset_caches":   # replica-0 committed
            assert "commit:2" in replicas[0].ws_call_log()      # and was rolled back
            assert rolled == [True, phase != "commit"]
        else:
            assert rolled == [False, False]
        report, ref3 = _step(manager, trainer, 3)
        assert report.ok and all(st.committed for st in report.replicas)
        assert not report.kept
        _all_serve(manager, replicas, ref3, 3)
        assert manager.verify().ok


def test_atomic_sync_phases_and_memory_cost():
    trainer, replicas, manager = _setup()
    with manager:
        report, ref = _step(manager, trainer, 1)
        assert report.phases == ["pause", "sync:full", "commit", "reset_caches", "release",
                                 "resume"]
        model = replicas[0].rollout.model
        weights = sum(p.numel() * p.element_size() for p in
                      {id(t): t for t in model.state_dict().values()}.values())
        assert [st.staged_bytes for st in report.replicas] == [weights, weights]
        assert report.staged_bytes == 2 * weights
        assert all(st.committed and st.version == 1 for st in report.replicas)
        assert all(r.rollout._staging is None for r in replicas)   # old copies released
        _all_serve(manager, replicas, ref, 1)


def test_atomic_from_the_environment(monkeypatch):
    trainer, rep = object(), object()
    monkeypatch.setenv("WEIGHTSYNC_ATOMIC", "1")
    assert CheckpointEngineManager("inproc", trainer, [rep]).atomic
    assert not CheckpointEngineManager("inproc", trainer, [rep], atomic=False).atomic
    monkeypatch.setenv("WEIGHTSYNC_ATOMIC", "off")
    assert not CheckpointEngineManager("inproc", trainer, [rep]).atomic
    monkeypatch.setenv("WEIGHTSYNC_ATOMIC", "maybe")
    with pytest.raises(ValueError, match="WEIGHTSYNC_ATOMIC"):
        CheckpointEngineManager("inproc", trainer, [rep])
    monkeypatch.delenv("WEIGHTSYNC_ATOMIC")
    assert not CheckpointEngineManager("inproc", trainer, [rep]).atomic


class VLLMLike(HFRolloutWorker):
    """Capabilities of a vLLM replica (no ``staged_kinds``: its staged apply commits at the
    end of its own receive)."""

    def ws_capabilities(self):
        caps = dict(super().ws_capabilities(), name="vllm", apply="staged")
        caps.pop("staged_kinds")
        return caps


def test_atomic_refuses_replicas_without_a_separate_commit():
    trainer = ToyTrainerWorker()
    trainer.build(CFG)
    replicas = [HFRolloutWorker(CFG, seed=5), VLLMLike(CFG, seed=6)]
    with CheckpointEngineManager("shm", [trainer], replicas, bucket_size=64 << 10, timeout=T,
                                 atomic=True) as manager:
        with pytest.raises(ValueError, match=r"replica-1 \(vllm\).*end of its own receive"):
            manager.update_weights(1)
        assert not any(x == "pause" for r in replicas for x in r.ws_call_log())


def test_atomic_refuses_adapter_syncs():
    trainer = ToyTrainerWorker()
    trainer.build(CFG, lora=lora_config(), lr=0.5)
    replica = HFRolloutWorker(CFG, seed=5)
    with CheckpointEngineManager("shm", [trainer], [replica], bucket_size=64 << 10, timeout=T,
                                 atomic=True) as manager:
        with pytest.raises(ValueError, match="PEFT layers"):
            manager.update_weights(1, merge_and_sync=False)
        report = manager.update_weights(2, merge_and_sync=True)   # merged: staged
        assert report.ok and report.kinds == ["full"]
        assert_matches(_gen(replica), trainer.reference(PROMPTS, 5, source="model"), 2,
                       exact=False)


def test_colocated_sleep_level_2_is_capped_at_1():
    trainer, replicas, manager = _setup(colocated=True, sleep_level=2)
    with manager:
        with pytest.warns(RuntimeWarning, match="atomic"):
            report, ref = _step(manager, trainer, 1)
        assert report.sleep_level == 1
        _all_serve(manager, replicas, ref, 1)


def test_after_the_decision_release_and_resume_failures_keep_the_new_version():
    trainer, replicas, manager = _setup()
    with manager:
        _step(manager, trainer, 1)
        replicas[1].fail("release")                 # keeps its old copy until its next sync
        report, ref2 = _step(manager, trainer, 2)
        assert report.ok and all(st.committed for st in report.replicas)
        assert replicas[1].rollout._staging is not None
        _all_serve(manager, replicas, ref2, 2)
        replicas[1].fail("resume")                  # committed everywhere, then left paused
        report, ref3 = _step(manager, trainer, 3)
        assert report.ok and all(st.committed for st in report.replicas)
        assert replicas[1].rollout._staging is None
        assert_matches(_gen(replicas[0]), ref3, 3)
        with pytest.raises(SyncTimeout, match="paused"):
            _gen(replicas[1], timeout=0.5)
        report, ref4 = _step(manager, trainer, 4)
        assert report.ok
        _all_serve(manager, replicas, ref4, 4)


def test_a_replica_hung_in_its_receive_is_isolated_the_other_keeps_its_version():
    trainer, replicas, manager = _setup()
    try:
        with manager:
            _, ref1 = _step(manager, trainer, 1)
            replicas[1].arm("hang", version=2)
            trainer.train_step(2)
            start = time.monotonic()
            with pytest.raises(WeightSyncError) as info:
                manager.update_weights(2)
            assert time.monotonic() - start < 2 * T + manager.settle + 20
            report = info.value.report
            assert report.isolated == ["replica-1"] and report.kept == {"replica-0": 1}
            assert "still running" in report.replicas[1].error
            assert manager.healthy_replicas() == [replicas[0]]
            assert_matches(_gen(replicas[0]), ref1, 1)
            replicas[1].release()
            deadline = time.monotonic() + 30
            while replicas[1].rollout._in_flight and time.monotonic() < deadline:
                time.sleep(0.1)
            assert manager.add_replica(replicas[1]) == "replica-1"
            report, ref3 = _step(manager, trainer, 3)
            assert report.ok
            _all_serve(manager, replicas, ref3, 3)
    finally:
        replicas[1].release()
