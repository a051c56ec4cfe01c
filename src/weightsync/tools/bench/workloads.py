"""Weight sets the bench moves: synthetic transformer-shaped checkpoints and a HF model.

A :class:`Workload` is only a description (names, shapes, dtype); every bench process
materializes it on its own: the trainer fills its tensors with deterministic values, each
receiver allocates zeroed tensors of the same shapes (its "model") that a sync must fill.

Synthetic sets look like a decoder-only transformer: an embedding (sized so that it is
bigger than the bucket, so chunking is always exercised), per layer the q/k/v/o
projections (grouped-query k/v), their biases, the gated MLP and two norms, and a final
norm. The hidden size grows with the target size so that matrices stay realistic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Workload", "synthetic", "tiny", "tensors_of", "hf_qwen2", "parse_size", "materialize", "zeros_like_spec",
           "GiB", "MiB"]

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class Workload:
    """Names and shapes of one weight set in one dtype."""

    name: str
    dtype: str
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    note: str = ""

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) for _, s in self.tensors) * self.itemsize

    @property
    def largest(self) -> int:
        return max((math.prod(s) for _, s in self.tensors), default=0) * self.itemsize

    def summary(self) -> dict:
        return {"workload": self.name, "dtype": self.dtype, "bytes": self.nbytes,
                "tensors": len(self.tensors), "largest_tensor_bytes": self.largest,
                "note": self.note}


def parse_size(text: str) -> int:
    """``"0.25"``/``"1"``/``"4"`` GiB, or with a unit: ``"16MiB"``, ``"1GiB"``."""
    raw = str(text).strip()
    units = {"gib": GiB, "g": GiB, "mib": MiB, "m": MiB, "kib": 1024, "k": 1024}
    low = raw.lower()
    for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if low.endswith(unit):
            low, scale = low[: -len(unit)], mult
            break
    else:
        scale = GiB
    try:
        value = float(low)
    except ValueError:
        raise ValueError(f"size {text!r} is not a number of GiB (or e.g. '64MiB')") from None
    if not value > 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return int(value * scale)


def _size_label(nbytes: int) -> str:
    if nbytes >= GiB and nbytes % (GiB // 4) == 0:
        return f"{nbytes / GiB:g}GiB"
    return f"{nbytes / MiB:g}MiB"


def synthetic(nbytes: int, dtype: str, *, bucket_size: int) -> Workload:
    """A transformer-shaped set of about ``nbytes`` bytes with one tensor > ``bucket_size``."""
    if dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
    item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    params = max(nbytes // item, 4096)
    hidden = 2 ** max(5, int(math.log2(math.sqrt(params / 126))))
    inter = max(64, int(round(hidden * 8 / 3 / 64)) * 64)
    kv = max(hidden // 4, 8)
    vocab = max(1024, -(-(bucket_size * 3 // 2) // (hidden * item)) + 7)
    layer = [("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.q_proj.bias", (hidden,)),
             ("self_attn.k_proj.weight", (kv, hidden)), ("self_attn.k_proj.bias", (kv,)),
             ("self_attn.v_proj.weight", (kv, hidden)), ("self_attn.v_proj.bias", (kv,)),
             ("self_attn.o_proj.weight", (hidden, hidden)),
             ("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
             ("mlp.down_proj.weight", (hidden, inter)),
             ("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,))]
    per_layer = sum(math.prod(s) for _, s in layer)
    left = params - vocab * hidden - hidden
    layers = max(1, round(left / per_layer))
    tensors = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        tensors += [(f"model.layers.{i}.{n}", s) for n, s in layer]
    tensors.append(("model.norm.weight", (hidden,)))
    return Workload(f"synthetic-{_size_label(nbytes)}", dtype, tuple(tensors),
                    note=f"hidden {hidden}, {layers} layers, vocab {vocab}")


def tiny(count: int, dtype: str) -> Workload:
    """``count`` tensors of 16 elements: what a sync costs per tensor, not per byte."""
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"the tiny workload needs a positive tensor count, got {count!r}")
    return Workload(f"tiny-{count}", dtype,
                    tuple((f"model.layers.{i // 8}.t{i % 8}", (16,)) for i in range(count)),
                    note=f"{count} tensors of 16 elements (per-tensor overhead)")


def tensors_of(workload_name: str) -> Optional[int]:
    """The tensor count of a tiny workload, from its name (None for other workloads)."""
    if workload_name.startswith("tiny-"):
        return int(workload_name.split("-", 1)[1])
    return None


def hf_qwen2(dtype: str = "bfloat16") -> tuple[Optional[Workload], str]:
    """Shapes of a config-built Qwen2 (~0.5B params, Qwen2.5-0.5B-like), no download.

    Returns ``(None, reason)`` when transformers is not installed.
    """
    try:
        from transformers import AutoModelForCausalLM, Qwen2Config
    except Exception as exc:  # ImportError, or a broken install
        return None, f"transformers not importable ({type(exc).__name__}); HF workload skipped"
    cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                      tie_word_embeddings=True, max_position_embeddings=4096)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    tensors = tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
    params = sum(math.prod(s) for _, s in tensors)
    return Workload("hf-qwen2-0.5b", dtype, tensors,
                    note=f"transformers Qwen2 from config, {params / 1e6:.0f}M params"), ""


def materialize(w: Workload, seed: int = 0) -> dict[str, torch.Tensor]:
    """The trainer's tensors: deterministic values, every page touched."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in w.tensors:
        t = torch.empty(shape, dtype=w.torch_dtype)
        t.uniform_(-1.0, 1.0, generator=g)
        out[name] = t
    return out


def zeros_like_spec(w: Workload) -> dict[str, torch.Tensor]:
    """A receiver's model tensors: zeroed (resident) tensors of the same shapes."""
    return {name: torch.zeros(shape, dtype=w.torch_dtype) for name, shape in w.tensors}
