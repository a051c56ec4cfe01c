"""A small Qwen2 built from a config (no download), random batches and prompts.

Used by ``weightsync demo`` and the tests; real code paths (transformers' Qwen2, PEFT)
on a model small enough for a 2-core CI machine.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["tiny_qwen2_config", "random_batch", "random_prompts", "lora_config", "word_tokenizer"]


def tiny_qwen2_config(*, vocab_size: int = 2048, hidden_size: int = 128, layers: int = 2,
                      intermediate_size: int = 352, heads: int = 4, kv_heads: int = 2) -> dict:
    """``Qwen2Config(...).to_dict()`` of a small model (JSON-able, rebuilt on the workers)."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size,
                      intermediate_size=intermediate_size, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=256, tie_word_embeddings=False)
    return cfg.to_dict()


def random_batch(step: int, rank: int, *, vocab_size: int, batch: int = 4,
                 length: int = 32) -> torch.Tensor:
    """Token ids of one training batch, different for every (step, rank)."""
    gen = torch.Generator().manual_seed(1_000_003 * (step + 1) + rank)
    return torch.randint(0, vocab_size, (batch, length), generator=gen)


def random_prompts(n: int, length: int, *, vocab_size: int, seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, length), generator=gen).tolist()


def lora_config(*, r: int = 8, alpha: int = 16, targets: Optional[list[str]] = None,
                random_init: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``peft.LoraConfig`` for the toy model."""
    return {"r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
            "target_modules": targets or ["q_proj", "k_proj", "v_proj", "o_proj"],
            "init_lora_weights": not random_init}


def word_tokenizer(folder: str, *, vocab_size: int):
    """A word-level tokenizer saved into ``folder`` (no download): the word ``w<id>`` is token
    ``id`` (2 to ``vocab_size - 1``), 0 is ``<pad>`` (also the unknown word), 1 is ``<eos>``.
    Returns the ``PreTrainedTokenizerFast``; what TRL and ``vllm serve`` need beside a model
    folder built from :func:`tiny_qwen2_config`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    raw = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", pad_token="<pad>")
    tok.save_pretrained(folder)
    return tok
