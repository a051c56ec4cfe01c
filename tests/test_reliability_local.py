"""Manager-level reliability with workers in this process (shm between threads): failure
isolation (a replica that fails or hangs mid-sync, or never arrives at init), validation
before bytes, verify, and no mixed versions under concurrent generation."""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("transformers")

from faultworkers import FaultyRollout  # noqa: E402
from syncchecks import assert_matches, same_logits  # noqa: E402
from weightsync.core.errors import PlanMismatch, SyncTimeout, WeightSyncError  # noqa: E402
from weightsync.core.digests import check_weight_set  # noqa: E402
from weightsync.orchestration.manager import CheckpointEngineManager  # noqa: E402
from weightsync.integrations.ray.workers import HFRolloutWorker, ToyTrainerWorker  # noqa: E402
from weightsync.testing.toymodel import lora_config, random_prompts, tiny_qwen2_config  # noqa: E402

pytestmark = pytest.mark.timeout(240)
CFG = tiny_qwen2_config(vocab_size=1001, hidden_size=64, intermediate_size=128)
PROMPTS = random_prompts(2, 6, vocab_size=1001)
T = 5.0          # engine timeout of these tests
BYPASS = threading.Lock()


def _trainer(lora=None, lr=0.05):
    t = ToyTrainerWorker()
    t.build(CFG, lora=lora, lr=lr)
    return t


def _manager(trainer, replicas, **kw):
    kw.setdefault("timeout", T)
    return CheckpointEngineManager("shm", [trainer], replicas, bucket_size=64 << 10, **kw)


def _gen(worker):
    return worker.generate(PROMPTS, max_new_tokens=5, return_logits=True)


def _step(manager, trainer, step, **kw):
    trainer.train_step(step)
    report = manager.update_weights(step, **kw)
    return report, trainer.reference(PROMPTS, 5)


def test_failing_replica_is_isolated_others_complete_and_it_comes_back():
    trainer = _trainer()
    replicas = [HFRolloutWorker(CFG, seed=5), FaultyRollout(CFG, seed=6),
                HFRolloutWorker(CFG, seed=7)]
    with _manager(trainer, replicas) as manager:
        _step(manager, trainer, 1)
        replicas[1].arm("raise")
        report, ref = _step(manager, trainer, 2)
        assert report.isolated == ["replica-1"] and report.retries == 1 and not report.ok
        (failed,) = report.failed
        assert failed.name == "replica-1" and failed.isolated
        assert "injected failure" in failed.error
        assert report.completed == ["replica-0", "replica-2"]
        for r in (replicas[0], replicas[2]):
            assert_matches(_gen(r), ref, 2)
        assert [manager.name_of(r) for r in manager.healthy_replicas()] == ["replica-0",
                                                                            "replica-2"]
        assert list(manager.failed_replicas()) == ["replica-1"]
        assert all(manager.route() is not replicas[1] for _ in range(6))
        for _ in range(3):
            assert_matches(manager.generate(PROMPTS, max_new_tokens=5, return_logits=True),
                           ref, 2)
        with pytest.raises(WeightSyncError, match="refuses"):
            replicas[1].generate(PROMPTS, max_new_tokens=2)      # fenced, never half-updated
        assert manager.verify().ok
        replicas[1].arm(None)
        assert manager.add_replica(replicas[1]) == "replica-1"
        assert all(r is not replicas[1] for r in manager.healthy_replicas())  # not yet synced
        report, ref = _step(manager, trainer, 3)
        assert report.ok and report.rebuilt and not report.isolated
        for r in replicas:
            assert_matches(_gen(r), ref, 3)
        check = manager.verify()
        assert check.ok and sorted(check.replicas) == ["replica-0", "replica-1", "replica-2"]


def test_hung_replica_is_isolated_within_the_bound():
    trainer = _trainer()
    replicas = [HFRolloutWorker(CFG, seed=5), FaultyRollout(CFG, seed=6)]
    try:
        with _manager(trainer, replicas) as manager:
            _step(manager, trainer, 1)
            replicas[1].arm("hang")
            start = time.monotonic()
            report, ref = _step(manager, trainer, 2)
            took = time.monotonic() - start
            assert report.isolated == ["replica-1"]
            assert "SyncTimeout" in report.failed[0].error
            assert_matches(_gen(replicas[0]), ref, 2)
            # trainer notices (T), the hung replica gets `settle` more, then one re-run
            assert took < 2 * T + manager.settle + 20, took
    finally:
        replicas[1].release()


@pytest.mark.parametrize("others", [0, 1], ids=["alone", "with-a-healthy-replica"])
def test_replica_that_never_arrives_at_init(others):
    trainer = _trainer()
    stuck = FaultyRollout(CFG, seed=6)
    stuck.arm_init("hang")
    replicas = [HFRolloutWorker(CFG, seed=5 + i) for i in range(others)] + [stuck]
    manager = _manager(trainer, replicas)
    start = time.monotonic()
    try:
        if not others:
            with pytest.raises(SyncTimeout) as info:
                manager.update_weights(1)
            assert "replica-0" in str(info.value)
        else:
            report, ref = _step(manager, trainer, 1)
            assert report.isolated == ["replica-1"] and report.completed == ["replica-0"]
            assert_matches(_gen(replicas[0]), ref, 1)
        assert time.monotonic() - start < T + manager.settle + 20
    finally:
        stuck.release()
        manager.shutdown()


def _snapshot(worker):
    return {n: t.detach().clone() for n, t in worker.rollout.model.state_dict().items()}


def _bad_replica(case):
    if case == "names":              # one decoder layer fewer: layers.1.* do not exist
        return HFRolloutWorker(tiny_qwen2_config(vocab_size=1001, hidden_size=64,
                                                 intermediate_size=128, layers=1), seed=6)
    if case == "shapes":
        return HFRolloutWorker(tiny_qwen2_config(vocab_size=1001, hidden_size=64,
                                                 intermediate_size=96), seed=6)
    worker = HFRolloutWorker(CFG, seed=6)
    norm = worker.rollout.model.model.norm
    norm.weight = torch.nn.Parameter(torch.ones(64, dtype=torch.int32), requires_grad=False)
    return worker


@pytest.mark.parametrize("case", ["names", "shapes", "dtypes"])
def test_plan_mismatch_before_any_byte_moves(case):
    trainer = _trainer()
    good, bad = HFRolloutWorker(CFG, seed=5), _bad_replica(case)
    with _manager(trainer, [good, bad]) as manager:
        before = [_snapshot(good), _snapshot(bad)]
        trainer.train_step(1)
        with pytest.raises(PlanMismatch) as info:
            manager.update_weights(1)
        err = info.value
        assert err.peer == "replica-1" and err.phase == "validate"
        assert list(err.problems) == ["replica-1"]
        expect = {"names": "model.layers.1.", "shapes": "mlp.", "dtypes": "model.norm.weight"}
        assert err.names and all(expect[case] in n for n in err.names), err.names
        assert expect[case] in str(err)
        for worker, snap in zip((good, bad), before):
            now = _snapshot(worker)
            assert all(torch.equal(snap[n], now[n]) for n in snap)      # nothing applied
            assert not any(x.startswith("load:") for x in worker.ws_call_log())
        assert good.generate(PROMPTS, max_new_tokens=2)[0].version is None   # not fenced


def test_check_weight_set_rules():
    targets = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.int64)}
    targets["tied"] = targets["a"]
    ok = [["a", [2, 3], "bfloat16"], ["b", [4], "int64"]]
    assert check_weight_set(targets, ok, complete=True) == []
    bad = [["a", [3, 2], "float32"], ["b", [4], "float32"], ["c", [1], "float32"]]
    found = {n: why for n, why in check_weight_set(targets, bad, complete=True)}
    assert set(found) == {"a", "b", "c"}
    assert "shape" in found["a"] and "dtype" in found["b"] and "no such" in found["c"]
    missing = check_weight_set(targets, ok[:1], complete=True)
    assert [n for n, _ in missing] == ["b"]
    assert check_weight_set(targets, ok[:1], complete=False) == []


@pytest.mark.parametrize("wire,held", [(None, torch.float32), (torch.bfloat16, torch.bfloat16),
                                       (torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16", "bf16-into-fp32"])
def test_verify_detects_a_corrupted_replica(wire, held):
    trainer = _trainer()
    replicas = [HFRolloutWorker(CFG, seed=5 + i, dtype=held) for i in range(2)]
    with _manager(trainer, replicas, dtype=wire) as manager:
        _step(manager, trainer, 1)
        first = manager.verify()
        assert first.ok and first.trainer["full"] == first.replicas["replica-1"]["digest"]["full"]
        weight = replicas[1].rollout.model.model.layers[0].mlp.up_proj.weight
        with torch.no_grad():
            weight.view(-1)[7] += 1.0
        found = manager.verify()
        assert not found.ok and found.bad == ["replica-1"]
        assert found.replicas["replica-1"]["mismatched"] == ["model.layers.0.mlp.up_proj.weight"]
        assert all(r is not replicas[1] for r in manager.healthy_replicas())
        with pytest.raises(WeightSyncError, match="refuses"):
            replicas[1].generate(PROMPTS, max_new_tokens=2)
        _step(manager, trainer, 2)
        assert manager.verify().ok and len(manager.healthy_replicas()) == 2


def test_verify_lora_adapter_syncs():
    trainer = _trainer(lora=lora_config(), lr=0.5)
    replica = HFRolloutWorker(CFG, seed=5)
    with _manager(trainer, [replica]) as manager:
        _step(manager, trainer, 1, merge_and_sync=False)
        check = manager.verify()
        assert check.ok and set(check.trainer) == {"base", "adapter"}
        lora_a = next(p for n, p in replica.rollout._peft.named_parameters() if "lora_A" in n)
        with torch.no_grad():
            lora_a.view(-1)[0] += 1.0
        bad = manager.verify().replicas["replica-0"]["mismatched"]
        assert len(bad) == 1 and "lora_A" in bad[0]


# -- no mixed versions ------------------------------------------------------------------
def _classify(gens, refs) -> bool:
    """True if every generation equals, token for token and logit for logit, the trainer's
    output for the version it carries (aborted ones: a prefix of it)."""
    for i, g in enumerate(gens):
        ref = refs.get(g.version)
        if ref is None:
            return False
        n = len(g.tokens)
        want_tokens, want_logits = ref["tokens"][i], ref["logits"][i]
        if g.tokens != want_tokens[:n] or (not g.aborted and n != len(want_tokens)):
            return False
        if not same_logits(g.logits[:n], want_logits[:n]):
            return False
    return True


class _Load:
    """Generation threads: each calls ``fn`` in a loop and records what came back."""

    def __init__(self, fns):
        self.records, self.refused, self.stop = [], 0, threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(fn,), daemon=True)
                        for fn in fns]

    def _loop(self, fn):
        while not self.stop.is_set():
            try:
                gens = fn()
            except WeightSyncError:
                with self.lock:
                    self.refused += 1
                time.sleep(0.02)
                continue
            with self.lock:
                self.records.append(gens)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(30)


@pytest.mark.parametrize("isolate", [True, False], ids=["isolating", "raising"])
def test_no_generation_mixes_versions(isolate):
    trainer = _trainer()
    replicas = [HFRolloutWorker(CFG, seed=5), FaultyRollout(CFG, seed=6)]
    manager = _manager(trainer, replicas, isolate_failures=isolate, timeout=10)
    refs = {}
    _, refs[0] = _step(manager, trainer, 0)

    def direct(worker):
        def fn():
            with BYPASS:     # the negative control below must not race a real generation
                return worker.generate(PROMPTS, max_new_tokens=5, return_logits=True, timeout=2)
        return fn

    def routed():
        return manager.generate(PROMPTS, max_new_tokens=5, return_logits=True, timeout=2)

    with _Load([direct(replicas[0]), direct(replicas[1]), routed]) as load:
        for step in range(1, 5):
            time.sleep(0.5)
            replicas[1].arm("raise" if step == 2 else None)
            if step == 2 and not isolate:
                with pytest.raises(WeightSyncError):
                    _step(manager, trainer, step)
                refs[step] = trainer.reference(PROMPTS, 5)
                assert not _classify(_bypassing_the_fence(replicas[1]), refs)  # negative control
            else:
                report, refs[step] = _step(manager, trainer, step)
                assert report.isolated == (["replica-1"] if step == 2 else [])
            if step == 2 and isolate:
                manager.add_replica(replicas[1])
        time.sleep(0.5)
    mixed = sum(not _classify(g, refs) for g in load.records)
    versions = {g[0].version for g in load.records}
    print(f"\nno-mixed-versions[{'isolating' if isolate else 'raising'}]: "
          f"{len(load.records)} generations, versions {sorted(versions)}, "
          f"{load.refused} refused while fenced/paused, {mixed} mixed")
    assert mixed == 0
    assert len(versions) >= 3 and len(load.records) >= 10
    manager.shutdown()


def _bypassing_the_fence(worker):
    """What a half-updated replica would produce if the fence were not there."""
    with BYPASS:
        return _unfenced(worker)


def _unfenced(worker):
    fence = worker.rollout._fence
    reason, fence.reason = fence.reason, None
    worker.rollout.gate.resume()
    try:
        return worker.generate(PROMPTS, max_new_tokens=5, return_logits=True, timeout=2)
    finally:
        fence.reason = reason
