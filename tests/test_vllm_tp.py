"""vLLM tensor parallel 2 (two worker processes) over ``nixl``: each worker pulls only the
slices its own vLLM loaders read (recorded from vLLM's ``load_weights`` on meta tensors),
and after the sync its parameters are bit-identical to what vLLM's own load of the same
full checkpoint gives it; ``verify()`` checks the slices each worker holds.

One vLLM engine with ``tensor_parallel_size=2`` (~40 s to start on this 2-core box:
``VLLM_CPU_OMP_THREADS_BIND="0|1"``, one core per worker) serves every test of the module.
"""

from __future__ import annotations

import os
import tempfile

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")
pytest.importorskip("transformers")

from syncchecks import assert_matches  # noqa: E402
from vllmhelpers import CFG  # noqa: E402
from weightsync.core.digests import tensor_digest  # noqa: E402
from weightsync.integrations.ray.vllm_workers import VLLMRolloutWorker  # noqa: E402
from weightsync.integrations.ray.workers import ToyTrainerWorker  # noqa: E402
from weightsync.orchestration.manager import CheckpointEngineManager  # noqa: E402
from weightsync.rollout.vllm.replica import VLLMOptions  # noqa: E402
from weightsync.testing.toymodel import random_prompts  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
PROMPTS = random_prompts(2, 6, vocab_size=CFG["vocab_size"])
NEW = 6


@pytest.fixture(scope="module")
def tp2():
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1",
           # the tests run functions in the workers through collective_rpc
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
           "VLLM_CACHE_ROOT": os.path.join(tempfile.gettempdir(), "wsvllm-cache")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    worker = VLLMRolloutWorker(CFG, seed=11, name="vllm-tp2",
                               options=VLLMOptions(multiprocess=True),
                               tensor_parallel_size=2)
    try:
        yield worker
    finally:
        worker.close()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _param_digests(worker):
    """Digests of every parameter and buffer this vLLM worker holds (after vLLM's
    processing: what generation reads)."""
    model = worker.model_runner.get_model()
    out = {f"p:{n}": tensor_digest(p.detach().contiguous())
           for n, p in model.named_parameters()}
    out.update({f"b:{n}": tensor_digest(b.contiguous()) for n, b in model.named_buffers()})
    return out


def _reload_from(worker, folder):
    """vLLM's own load of a full checkpoint folder into this worker."""
    worker.reload_weights(weights_path=folder)
    return True


def test_each_worker_pulls_its_slices_and_matches_vllms_own_load(tp2, tmp_path):
    rep = tp2.rollout
    assert rep.world_size == 2
    trainer = ToyTrainerWorker()
    trainer.build(CFG, lr=0.05)
    full = sum(p.numel() * p.element_size() for p in trainer.model.state_dict().values())
    with CheckpointEngineManager("nixl", [trainer], [tp2], bucket_size=1 << 20,
                                 timeout=60) as manager:
        before = rep.llm.collective_rpc(_param_digests)
        for step in (1, 2):
            trainer.train_step(step)
            report = manager.update_weights(step)
            assert report.ok, report
        pulled = rep.last_sync_stats()["worker_pulled_bytes"]
        synced = rep.llm.collective_rpc(_param_digests)
        check = manager.verify()
        assert check.ok, check.replicas
        digests = rep.weight_digests()["digests"]
        assert any(k.endswith("]") for k in digests)        # slices were hashed as slices
        after_sync = rep.generate(PROMPTS, max_new_tokens=NEW, return_logits=True)
        assert_matches(after_sync, trainer.reference(PROMPTS, NEW), 2, exact=False)

        folder = str(tmp_path / "step2")
        trainer.model.save_pretrained(folder)
        rep.llm.collective_rpc(_reload_from, args=(folder,))
        own = rep.llm.collective_rpc(_param_digests)
    # every byte each worker holds is what vLLM's own loader made of the full checkpoint
    for rank in range(2):
        changed = [k for k in own[rank] if own[rank][k] != before[rank][k]]
        assert changed, "the trainer's steps changed nothing"
        bad = sorted(k for k in own[rank] if synced[rank].get(k) != own[rank][k])
        assert bad == [], (rank, bad[:8])
    # each worker pulled about half the model, not all of it
    assert len(pulled) == 2
    for b in pulled:
        assert b <= 0.55 * full, (pulled, full)
    assert sum(pulled) >= full * 0.99       # between them, every byte


def test_a_worker_whose_loader_cannot_be_recorded_pulls_that_tensor_whole(tp2, tmp_path):
    """A loader the recorder cannot map (here: an ``item()`` on the loaded weight) makes
    that tensor a full pull, named in the plan's notes; the others stay slices. Recorded
    after a layerwise reload (whose wrappers stay on vLLM's metadata tensors and load
    nothing outside a reload: the recorder must see through them)."""
    from weightsync.rollout.hf import build_causal_lm
    from weightsync.rollout.vllm.slices import record_slices

    folder = str(tmp_path / "m")
    build_causal_lm(CFG, seed=3).save_pretrained(folder)
    tp2.rollout.llm.collective_rpc(_reload_from, args=(folder,))

    def probe(worker):
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        model = worker.model_runner.get_model()
        # the loader vLLM runs on a reload: the one on its model-format metadata
        meta = LAYERWISE_INFO[model.model.layers[0].input_layernorm].restore_metadata[0]["weight"]
        original = meta.__dict__.get("weight_loader")

        def scalar_loader(param, loaded):
            float(loaded.view(-1)[0].item())      # no data on the meta device
            param.data.copy_(loaded)

        meta.weight_loader = scalar_loader
        try:
            keep = record_slices(worker, [
                ("model.layers.0.input_layernorm.weight", (128,), "float32"),
                ("model.layers.0.mlp.down_proj.weight", (128, 352), "float32")])
        finally:
            if original is None:
                del meta.weight_loader
            else:
                meta.weight_loader = original
        return {"boxes": {n: [list(map(list, b)) for b in v] for n, v in keep.boxes.items()},
                "notes": list(keep.notes)}

    out = tp2.rollout.llm.collective_rpc(probe)
    for rank, r in enumerate(out):
        assert "model.layers.0.input_layernorm.weight" not in r["boxes"], r
        assert any("input_layernorm" in n for n in r["notes"]), r
        cols = (0, 176) if rank == 0 else (176, 352)
        assert r["boxes"]["model.layers.0.mlp.down_proj.weight"] == [[[0, 128], list(cols)]], out


def test_a_tensor_parallel_replica_joins_pulling_only_its_slices(tp2, monkeypatch):
    """``add_replica`` of the TP 2 vLLM replica after a sync: each of its workers pulls
    only its slices of the current version, from the trainer's arena, then (removed and
    added again) from a healthy HF replica that holds it whole; each time it then
    generates what the trainer's model of that version does."""
    from weightsync.integrations.ray.workers import HFRolloutWorker

    # the trainer keeps each version in its arena (with ``auto`` it serves its live
    # parameters, which hold no past version to offer)
    monkeypatch.setenv("WEIGHTSYNC_NIXL_SERVE", "staging")
    trainer = ToyTrainerWorker()
    trainer.build(CFG, lr=0.05)
    full = sum(p.numel() * p.element_size() for p in trainer.model.state_dict().values())
    first = HFRolloutWorker(CFG, seed=5)
    with CheckpointEngineManager("nixl", [trainer], [first], bucket_size=1 << 20,
                                 timeout=60) as manager:
        for step, source in ((1, "trainer"), (2, "replica")):
            trainer.train_step(step)
            assert manager.update_weights(step).ok
            ref = trainer.reference(PROMPTS, NEW)
            trainer.train_step(step + 10)          # the trainer moves on
            manager.add_replica(tp2, join_from=source)
            joined = manager.last_join
            assert joined["source"] == ("trainer ranks" if source == "trainer" else "replica-0")
            assert tp2 in manager.healthy_replicas()
            pulled = joined["worker_pulled_bytes"]
            assert len(pulled) == 2 and all(b <= 0.55 * full for b in pulled), (pulled, full)
            assert_matches(tp2.rollout.generate(PROMPTS, max_new_tokens=NEW,
                                                return_logits=True), ref, step, exact=False)
            manager.remove_replica(tp2)
