"""PEFT LoRA helpers: HF names of the base model, adapter names, merged deltas, config.

Works on the module tree only (no ``merge_adapter`` calls): the merged weight of a LoRA
linear is computed as ``W + delta`` into a new tensor, with ``delta`` computed exactly as
PEFT's ``get_delta_weight`` does, so the exported tensors equal PEFT's merged weights
bit for bit while the trainer's model is never modified (an in-place merge followed by an
unmerge is not exact in floating point).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["is_peft_model", "LoraLinearInfo", "lora_linears", "hf_name", "adapter_name",
           "lora_delta", "lora_config_dict", "check_supported", "active_adapter"]

_PEFT_PREFIX = "base_model.model."


def is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "base_model") and \
        hasattr(model, "active_adapter")


def active_adapter(model: torch.nn.Module) -> str:
    name = model.active_adapter
    if not isinstance(name, str):
        if isinstance(name, (list, tuple)) and len(name) == 1:
            return name[0]
        raise ValueError(f"exactly one active LoRA adapter is supported, got {name!r}")
    return name


def hf_name(peft_name: str) -> str:
    """``base_model.model.x.q_proj.base_layer.weight`` -> ``x.q_proj.weight``."""
    name = peft_name[len(_PEFT_PREFIX):] if peft_name.startswith(_PEFT_PREFIX) else peft_name
    return name.replace(".base_layer.", ".")


def adapter_name(peft_name: str, adapter: str) -> str:
    """``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight`` (PEFT's file names)."""
    return peft_name.replace(f".{adapter}.", ".")


def is_lora_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def check_supported(state_names: list[str]) -> None:
    """Reject PEFT features whose weights this exporter does not know how to move."""
    bad = [n for n in state_names
           if any(k in n for k in ("lora_magnitude_vector", "lora_embedding_", "modules_to_save",
                                   "lora_bias"))]
    if bad:
        raise ValueError("weightsync exports plain LoRA on Linear layers only (no DoRA, embedding "
                         f"LoRA, lora_bias or modules_to_save); unsupported tensors: {bad[:5]}")


@dataclass(frozen=True)
class LoraLinearInfo:
    module: str              # module path of the LoRA layer in the PEFT model
    scaling: float
    fan_in_fan_out: bool


def lora_linears(model: torch.nn.Module, adapter: str) -> dict[str, LoraLinearInfo]:
    """LoRA Linear layers of ``adapter`` by module path."""
    out = {}
    for name, mod in model.named_modules():
        lora_a = getattr(mod, "lora_A", None)
        if isinstance(lora_a, torch.nn.ModuleDict) and adapter in lora_a:
            if not isinstance(lora_a[adapter], torch.nn.Linear):
                raise ValueError(f"{name}: LoRA on {type(lora_a[adapter]).__name__} is not supported")
            out[name] = LoraLinearInfo(name, float(mod.scaling[adapter]),
                                       bool(getattr(mod, "fan_in_fan_out", False)))
    return out


def lora_delta(info: LoraLinearInfo, weight_a: torch.Tensor, weight_b: torch.Tensor) -> torch.Tensor:
    """PEFT's ``get_delta_weight`` for a Linear LoRA layer, from full A and B."""
    dtype = weight_b.dtype
    cast = weight_b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    if cast:
        weight_a, weight_b = weight_a.float(), weight_b.float()
    out = weight_b @ weight_a
    if info.fan_in_fan_out:
        out = out.T
    out = out * info.scaling
    return out.to(dtype) if cast else out


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "to_dict"):
        return _jsonable(value.to_dict())
    raise ValueError(f"PEFT config value {value!r} is not JSON-serializable")


def lora_config_dict(model: torch.nn.Module, adapter: Optional[str] = None) -> dict[str, Any]:
    """The adapter's PEFT config as a JSON-able dict (what the rollout rebuilds it from)."""
    adapter = adapter or active_adapter(model)
    cfg = model.peft_config[adapter]
    data = _jsonable(cfg.to_dict())
    json.dumps(data)  # must round-trip as JSON
    return data
