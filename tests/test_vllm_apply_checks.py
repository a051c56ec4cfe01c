"""The completeness check of a vLLM load (``rollout/vllm/apply.py``) on fakes: no vLLM
needed. Every parameter of the model must be written by a sync, except the attention
scales vLLM's FP8 layers create with defaults (FP8 checkpoints carry none of them)."""

from types import SimpleNamespace

import pytest
import torch

from weightsync.core.errors import PlanMismatch
from weightsync.rollout.vllm.apply import _check_complete


class _Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for n in ("q_scale", "k_scale", "v_scale", "prob_scale"):
            setattr(self, n, torch.nn.Parameter(torch.ones(()), requires_grad=False))


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = torch.nn.Linear(4, 12, bias=False)
        self.qkv_proj.weight_scale_inv = torch.nn.Parameter(torch.ones(1, 1),
                                                            requires_grad=False)
        self.attn = _Attn()


def _worker():
    return SimpleNamespace(vllm_config=SimpleNamespace(lora_config=None))


def test_fp8_attention_scales_are_not_required():
    model = torch.nn.Module()
    model.layer = _Layer()
    loaded = {"layer.qkv_proj.weight", "layer.qkv_proj.weight_scale_inv"}
    _check_complete(_worker(), model, [], loaded, {}, 3, "replica-0")      # no raise


def test_a_weight_or_scale_left_out_is_still_an_error():
    model = torch.nn.Module()
    model.layer = _Layer()
    with pytest.raises(PlanMismatch, match="weight_scale_inv"):
        _check_complete(_worker(), model, [], {"layer.qkv_proj.weight"}, {}, 3, "replica-0")
