"""The HF rollout replica on its own: loads, versions, LoRA, sleep/wake, pause/abort."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from syncchecks import assert_matches  # noqa: E402
from weightsync.core.errors import PlanMismatch, WeightSyncError  # noqa: E402
from weightsync.rollout.hf import HFRolloutReplica, build_causal_lm, greedy_generate  # noqa: E402
from weightsync.testing.toymodel import lora_config, random_prompts, tiny_qwen2_config  # noqa: E402
from weightsync.trainer import export_weights, lora_config_dict  # noqa: E402

pytestmark = pytest.mark.timeout(180)
CFG = tiny_qwen2_config(vocab_size=1001, hidden_size=64, intermediate_size=128)
PROMPTS = random_prompts(2, 6, vocab_size=1001)


async def _stream(items):
    for item in items:
        yield item


def load(rep, items, version, kind="full", adapter_config=None):
    return asyncio.run(rep.load_weights(_stream(list(items)), version=version, kind=kind,
                                        adapter_config=adapter_config))


def reference(model):
    tokens, logits, _ = greedy_generate(model.eval(), PROMPTS, 5)
    return {"tokens": tokens, "logits": logits}


def gen(rep):
    return rep.generate(PROMPTS, max_new_tokens=5, return_logits=True)


@pytest.fixture
def trainer_model():
    return build_causal_lm(CFG, seed=0)


def test_full_load_versions_and_equality(trainer_model):
    rep = HFRolloutReplica(config=CFG, seed=99)
    assert rep.current_version() is None
    load(rep, export_weights(trainer_model), 7)
    assert rep.current_version() == 7
    assert_matches(gen(rep), reference(trainer_model), 7)


def test_incomplete_or_unknown_sync_fences_the_replica(trainer_model):
    rep = HFRolloutReplica(config=CFG, seed=99)
    items = list(export_weights(trainer_model))
    with pytest.raises(PlanMismatch, match="unwritten"):
        load(rep, items[:-1], 1)
    with pytest.raises(WeightSyncError, match="refuses"):
        gen(rep)
    with pytest.raises(PlanMismatch, match="no tensor named"):
        load(rep, [("nope.weight", torch.zeros(2))], 1)
    load(rep, items, 2)
    assert_matches(gen(rep), reference(trainer_model), 2)


def test_sleep_level1_keeps_weights_level2_needs_a_sync(trainer_model):
    rep = HFRolloutReplica(config=CFG, seed=99)
    load(rep, export_weights(trainer_model), 1)
    ref = reference(trainer_model)
    rep.sleep(1)
    with pytest.raises(WeightSyncError, match="asleep"):
        gen(rep)
    with pytest.raises(WeightSyncError, match="wake_up"):
        load(rep, export_weights(trainer_model), 2)
    rep.wake_up(["weights"])
    with pytest.raises(WeightSyncError, match="asleep"):
        gen(rep)                              # kv_cache still asleep
    rep.wake_up(["kv_cache"])
    assert_matches(gen(rep), ref, 1)          # nothing lost
    rep.sleep(2)
    rep.wake_up()
    with pytest.raises(PlanMismatch, match="discarded"):
        gen(rep)                              # weights were discarded, not restored
    load(rep, export_weights(trainer_model), 2)
    assert_matches(gen(rep), ref, 2)
    with pytest.raises(ValueError):
        rep.sleep(3)
    with pytest.raises(ValueError):
        rep.wake_up(["weights", "bogus"])


def test_pause_aborts_running_generation_and_blocks_new_ones(trainer_model):
    rep = HFRolloutReplica(config=CFG, seed=99, timeout=30)
    results = {}

    def long_generation():
        results["long"] = rep.generate(PROMPTS, max_new_tokens=2000)

    t = threading.Thread(target=long_generation)
    t.start()
    time.sleep(0.5)
    rep.pause(abort=True)
    t.join(30)
    assert results["long"][0].aborted and len(results["long"][0].tokens) < 2000

    def later():
        results["later"] = rep.generate(PROMPTS, max_new_tokens=2)

    t2 = threading.Thread(target=later)
    t2.start()
    time.sleep(0.3)
    assert "later" not in results           # waits while paused
    rep.resume()
    t2.join(30)
    assert not results["later"][0].aborted and len(results["later"][0].tokens) == 2


class AdapterIgnoringReplica(HFRolloutReplica):
    """A replica with the classic bug: receives the adapter but never applies it."""

    async def load_weights(self, weights, *, version, kind, adapter_config):
        if kind != "adapter":
            return await super().load_weights(weights, version=version, kind=kind,
                                              adapter_config=adapter_config)
        async for _ in weights:
            pass
        self._version = version
        return {"tensors": 0}


def _lora_trainer():
    model = build_causal_lm(CFG, seed=0)
    torch.manual_seed(3)
    return peft.get_peft_model(model, peft.LoraConfig(**lora_config(random_init=True))).eval()


@pytest.mark.parametrize("cls", [HFRolloutReplica, AdapterIgnoringReplica],
                         ids=["real", "adapter-ignored"])
def test_adapter_is_really_used(cls):
    trainer = _lora_trainer()
    ref = reference(trainer)
    rep = cls(config=CFG, seed=99)
    load(rep, export_weights(trainer, kind="base"), 1, "base")
    load(rep, export_weights(trainer, kind="adapter"), 1, "adapter", lora_config_dict(trainer))
    if cls is AdapterIgnoringReplica:
        with pytest.raises(AssertionError):
            assert_matches(gen(rep), ref, 1)
        return
    assert rep.has_adapter()
    assert_matches(gen(rep), ref, 1)
    # a merged full sync replaces the adapter with merged weights
    load(rep, export_weights(trainer, kind="full"), 2)
    assert not rep.has_adapter()
    assert_matches(gen(rep), ref, 2, exact=False)


def test_share_memory_keeps_the_weights_shared_through_sleep_and_staging(trainer_model):
    with pytest.raises(ValueError, match="CPU replica"):
        HFRolloutReplica(config=CFG, seed=99, device="cuda", share_memory=True)
    with pytest.raises(ValueError, match="bool"):
        HFRolloutReplica(config=CFG, seed=99, share_memory="yes")
    rep = HFRolloutReplica(config=CFG, seed=99, share_memory=True)

    def all_shared():
        return all(t.is_shared() for t in rep.model.state_dict().values())
    assert all_shared()
    load(rep, export_weights(trainer_model), 1)
    assert all_shared()
    rep.sleep(2)
    rep.wake_up()                         # weights re-allocated: in shared memory again
    assert all_shared()
    load(rep, export_weights(trainer_model), 2)
    assert_matches(gen(rep), reference(trainer_model), 2)
    rep.begin_sync(3, ["full"], staged=True)   # the staging copy is shared too, so the
    staging = rep._staging_of(3)               # trainer can write a staged sync into it
    targets = staging.targets(rep._base_targets())
    assert targets and all(t.is_shared() for t in targets.values())
    assert not HFRolloutReplica(config=CFG, seed=99).model.lm_head.weight.is_shared()
