"""Options and helpers of the vLLM replica (no vLLM import at module level)."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from weightsync.core import errors as _errors
from weightsync.core.config import option, parse_bool
from weightsync.core.errors import PeerFailed, WeightSyncError

__all__ = ["EXTENSION", "VLLMOptions", "check_prompts", "error_from_reply", "model_folder_from_config", "env_set",
           "host_process_kept", "max_positions", "check_may_generate"]

_APPLY = ("stream", "staged")
_LOADERS = ("auto", "layerwise", "direct")

#: What ``vllm.LLM(worker_extension_cls=...)`` is given: the worker side of a replica.
EXTENSION = "weightsync.rollout.vllm.extension.WeightSyncWorkerExtension"


@dataclass(kw_only=True)
class VLLMOptions:
    """How a :class:`~weightsync.rollout.vllm.VLLMRolloutReplica` runs vLLM.

    ``apply``: ``"stream"`` or ``"staged"`` (see ``vllm_ext``; env
    ``WEIGHTSYNC_VLLM_APPLY``). ``loader``: ``"auto"`` (layerwise reload on CPU, direct
    ``load_weights`` elsewhere), ``"layerwise"`` or ``"direct"`` (``WEIGHTSYNC_VLLM_LOADER``).
    ``multiprocess``: vLLM's default process model (driver, engine core, worker processes)
    or everything in this process (``WEIGHTSYNC_VLLM_MULTIPROCESS``; sets
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` while the LLM starts). ``kv_cache_bytes``: KV cache
    size (``WEIGHTSYNC_VLLM_KV_CACHE_BYTES``; without it vLLM-CPU reserves 90 % of RAM).
    ``timeout``: seconds any RPC other than a sync may take. ``digests``: hash every
    received tensor for ``verify`` (``WEIGHTSYNC_VLLM_DIGESTS``; costs one pass over the
    weights per sync, a device-to-host copy on GPU; off: ``verify`` reports an error).
    """

    apply: str = option("VLLM_APPLY", str, "stream",
                        "How received weights reach the model: \"stream\" or \"staged\".")
    loader: str = option("VLLM_LOADER", str, "auto",
                         "\"auto\", \"layerwise\" (reload layer by layer) or \"direct\" "
                         "(load_weights).")
    multiprocess: bool = option("VLLM_MULTIPROCESS", parse_bool, True,
                                "vLLM's own process model, or everything in this process.")
    digests: bool = option("VLLM_DIGESTS", parse_bool, True,
                           "Hash every received tensor, for verify().")
    kv_cache_bytes: int = option("VLLM_KV_CACHE_BYTES", int, 64 << 20, "KV cache size in bytes.")
    max_model_len: int = 512
    max_num_seqs: int = 8
    enable_lora: bool = False
    max_lora_rank: int = 16
    enforce_eager: bool = True
    timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.apply not in _APPLY:
            raise ValueError(f"apply must be one of {_APPLY}, got {self.apply!r}")
        if self.loader not in _LOADERS:
            raise ValueError(f"loader must be one of {_LOADERS}, got {self.loader!r}")
        for name in ("kv_cache_bytes", "max_model_len", "max_num_seqs", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        for name in ("multiprocess", "enable_lora", "enforce_eager", "digests"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


def model_folder_from_config(config: Any, folder: str, *, dtype: Any = torch.float32,
                             seed: int = 0) -> str:
    """Build a causal LM from a config (random weights) and ``save_pretrained`` it."""
    from weightsync.rollout.hf import build_causal_lm

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = build_causal_lm(config, dtype=dtype, seed=seed)
    model.save_pretrained(folder)
    return folder


def error_from_reply(err: dict, *, phase: str, version: Any, peer: str) -> BaseException:
    """The exception a worker reported (``{"type", "message", ...}``), rebuilt."""
    name, message = str(err.get("type")), str(err.get("message"))
    cls = getattr(_errors, name, None) if name in _errors.__all__ else None
    if cls is not None:
        return cls(message, peer=err.get("peer") or peer, phase=err.get("phase") or phase,
                   version=err.get("version", version), origin=err.get("origin"))
    if name == "ValueError":
        return ValueError(f"{peer}: {message}")
    return PeerFailed(f"{name}: {message}", peer=peer, phase=phase, version=version)


def max_positions(model: str) -> Optional[int]:
    try:
        with open(os.path.join(model, "config.json")) as f:
            value = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


@contextlib.contextmanager
def host_process_kept(active: bool) -> Iterator[None]:
    """In-process vLLM seeds the global RNGs and replaces ``torch.set_num_threads`` with a
    no-op in the calling process; put both back for the host program."""
    if not active:
        yield
        return
    import random

    set_threads, torch_rng, py_rng = torch.set_num_threads, torch.get_rng_state(), \
        random.getstate()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_rng_state(torch_rng)
        random.setstate(py_rng)


@contextlib.contextmanager
def env_set(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def check_may_generate(name: str, asleep: dict, fence: Any, version: Any) -> None:
    """A ``WeightSyncError`` (phase ``generate``) when the replica ``name`` must not generate
    now: any of ``asleep`` (sleep tag -> asleep) is true, or ``fence`` (its
    :class:`~weightsync.rollout.protocol.SyncFence`) is blocked."""
    if any(asleep.values()):
        raise WeightSyncError(f"{name} is asleep ({asleep}); wake_up first",
                              phase="generate", version=version)
    if fence.blocked:
        raise WeightSyncError(f"{name} refuses to generate: {fence.blocked}",
                              phase="generate", version=version)


def check_prompts(prompts: Any, max_new_tokens: int, *, vocab_size: int,
                  max_model_len: int) -> list:
    """Token-id prompts as lists of ints, or a ``ValueError`` saying what is wrong."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    out = []
    for p in prompts:
        p = [int(t) for t in p]
        if not p:
            raise ValueError("prompts must not be empty")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"token ids must be in [0, {vocab_size}), got {p[:8]}")
        if len(p) + max_new_tokens > max_model_len:
            raise ValueError(f"prompt of {len(p)} + {max_new_tokens} new tokens exceeds "
                             f"max_model_len {max_model_len}")
        out.append(p)
    return out
