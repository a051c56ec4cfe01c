"""What the vLLM test modules share: the tiny model they all load, and a temp HOME.

vLLM writes caches under HOME (and XDG_CACHE_HOME); a module that starts vLLM points both at
a temp folder for its lifetime (``vllm_home``), which also holds the model folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

from weightsync.testing.toymodel import tiny_qwen2_config

VOCAB = 1000
# hidden 128 / 4 heads: head_dim 32, the smallest the CPU attention kernel takes;
# initializer_range 0.2 gives peaky logits, so greedy comparisons mean something.
CFG = {**tiny_qwen2_config(vocab_size=VOCAB), "max_position_embeddings": 512,
       "initializer_range": 0.2}


@contextlib.contextmanager
def vllm_home(config: dict = CFG, *, seed: int = 1, prefix: str = "wsvllm-") -> Iterator[str]:
    """HOME, XDG_CACHE_HOME (and VLLM_NO_USAGE_STATS) set to a temp folder, restored after;
    yields the path of a model folder built from ``config`` (random weights, ``seed``)."""
    from weightsync.rollout.hf import build_causal_lm

    root = tempfile.mkdtemp(prefix=prefix)
    keys = ("HOME", "XDG_CACHE_HOME", "VLLM_NO_USAGE_STATS")
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(HOME=root, XDG_CACHE_HOME=os.path.join(root, ".cache"),
                      VLLM_NO_USAGE_STATS="1")
    try:
        folder = os.path.join(root, "model")
        build_causal_lm(config, seed=seed).save_pretrained(folder)
        yield folder
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)
