"""Which tensors a model has: names and shapes from the model built on the meta device.

Owns :class:`ModelSpec` and :func:`load_model`. A model is named by a preset
(``presets/models/*.json``: ``kimi-k2``, ``qwen3-235b-a22b``), an HF config folder or
JSON file, or a transformers config class with its defaults (``DeepseekV3Config``,
``Qwen3MoeConfig``, ...). The whole model is built with ``AutoModelForCausalLM
.from_config`` under ``torch.device("meta")``: no weights, no download, and fast enough
(Kimi-K2, 1.03 T parameters: ~0.2 s, ~0.4 GB) that no per-layer replication is needed.
Tensors are the state dict's, tied ones once, in model order: what the trainer's export
yields. :func:`model_from_tensors` wraps a plain list (the bench workloads).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from weightsync.tools.planner.errors import PlannerError

__all__ = ["ModelSpec", "load_model", "model_from_tensors", "model_presets", "MODEL_DIR"]

MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets", "models")


@dataclass(frozen=True)
class ModelSpec:
    """Named shapes of one model; ``kv_heads``/``head_dim`` for the k/v slicing rule."""

    name: str
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    note: str = ""
    config: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def params(self) -> int:
        return sum(math.prod(s) for _, s in self.tensors)


def model_presets() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(MODEL_DIR) if f.endswith(".json"))


def model_from_tensors(name: str, tensors: Sequence[tuple[str, Sequence[int]]], *,
                       kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                       note: str = "") -> ModelSpec:
    return ModelSpec(name, tuple((n, tuple(int(d) for d in s)) for n, s in tensors),
                     kv_heads, head_dim, note)


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as exc:
        raise PlannerError("model", f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise PlannerError("model", f"{path} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise PlannerError("model", f"{path} does not hold a config mapping")
    return doc


def _config_from_dict(doc: dict, where: str) -> Any:
    from transformers import AutoConfig
    doc = {k: v for k, v in doc.items() if not k.startswith("_") and k != "quantization_config"}
    model_type = doc.pop("model_type", None)
    if not model_type:
        raise PlannerError("model.model_type", f"{where} has no model_type")
    try:
        return AutoConfig.for_model(model_type, **doc)
    except ValueError as exc:
        if "Unrecognized model identifier" in str(exc) or model_type in str(exc):
            raise PlannerError("model.model_type", f"unknown architecture {model_type!r} "
                                                   f"(in {where})") from None
        raise PlannerError("model", f"{where}: {exc}") from None


def _resolve_config(spec: str) -> tuple[Any, str]:
    if spec in model_presets():
        return _config_from_dict(_read_json(os.path.join(MODEL_DIR, spec + ".json")), spec), spec
    if os.path.isdir(spec):
        path = os.path.join(spec, "config.json")
        if not os.path.exists(path):
            raise PlannerError("model", f"folder {spec} has no config.json")
        return _config_from_dict(_read_json(path), path), os.path.basename(os.path.normpath(spec))
    if spec.endswith(".json") or os.path.exists(spec):
        return _config_from_dict(_read_json(spec), spec), os.path.basename(spec)[:-5]
    import transformers
    cls = getattr(transformers, spec, None) if spec.endswith("Config") else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig)):
        raise PlannerError("model", f"unknown architecture or file {spec!r}: give a preset "
                                    f"({', '.join(model_presets())}), an HF config folder or "
                                    "JSON file, or a transformers config class (e.g. "
                                    "DeepseekV3Config)")
    return cls(), spec


def _override(cfg: Any, overrides: Mapping[str, Any]) -> None:
    for key, value in overrides.items():
        if not hasattr(cfg, key):
            raise PlannerError(f"model.set.{key}", f"{type(cfg).__name__} has no field {key!r}")
        setattr(cfg, key, value)


def _build(cfg: Any, name: str) -> list[tuple[str, tuple[int, ...]]]:
    import torch
    from transformers import AutoModelForCausalLM
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except ValueError as exc:
        raise PlannerError("model", f"{name}: transformers has no causal LM for "
                                    f"{type(cfg).__name__}: {str(exc).splitlines()[0]}") from None
    except Exception as exc:  # a config transformers refuses (e.g. heads that do not divide)
        raise PlannerError("model", f"{name}: building it on the meta device failed: "
                                    f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    seen, out = set(), []
    for n, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((n, tuple(int(d) for d in t.shape)))
    return out


def _bench_workload(spec: str) -> ModelSpec:
    """``bench:<workload>[:<dtype>]``: a ``weightsync bench`` weight set (64 MiB buckets)."""
    from weightsync.tools.bench.workloads import MiB, hf_qwen2, parse_size, synthetic
    _, name, *rest = spec.split(":")
    dtype = rest[0] if rest else "bfloat16"
    try:
        if name == "hf-qwen2-0.5b":
            w, why = hf_qwen2(dtype)
            if w is None:
                raise ValueError(why)
        elif name.startswith("synthetic-"):
            w = synthetic(parse_size(name[len("synthetic-"):]), dtype, bucket_size=64 * MiB)
        else:
            raise ValueError("known: synthetic-<size>, hf-qwen2-0.5b")
    except ValueError as exc:
        raise PlannerError("model", f"bench workload {name!r}: {exc}") from None
    return model_from_tensors(w.name, w.tensors, note=w.note)


def load_model(spec: str, overrides: Optional[Mapping[str, Any]] = None) -> ModelSpec:
    """Shapes of ``spec`` (see the module doc), with config fields replaced by
    ``overrides`` (e.g. ``{"num_hidden_layers": 2}``) before the model is built.
    ``bench:synthetic-1GiB`` (or ``bench:hf-qwen2-0.5b``) names a bench weight set."""
    if spec.startswith("bench:"):
        return _bench_workload(spec)
    cfg, name = _resolve_config(spec)
    _override(cfg, dict(overrides or {}))
    tensors = _build(cfg, name)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or (
        cfg.hidden_size // heads if heads and getattr(cfg, "hidden_size", None) else None)
    params = sum(math.prod(s) for _, s in tensors)
    return ModelSpec(name, tuple(tensors), kv, hd,
                     note=f"{type(cfg).__name__}, {params / 1e9:.2f} B parameters, "
                          f"{len(tensors)} tensors (built on the meta device)",
                     config=cfg.to_dict())
