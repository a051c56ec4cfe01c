"""Rollout side: the adapter protocol the manager drives, and the HF transformers replica.

``weightsync.rollout.hf`` imports transformers (and peft for LoRA) lazily on use;
``weightsync.rollout.vllm`` imports vLLM lazily (``weightsync.rollout.vllm.server_replica``
never: it drives a ``vllm serve`` process over HTTP).
"""

from weightsync.rollout.protocol import (SLEEP_LEVELS, WAKE_TAGS, WEIGHT_KINDS, Generation, GenerationGate,
                   LocalEngineRollout, RolloutAdapter)

__all__ = ["RolloutAdapter", "LocalEngineRollout", "Generation", "GenerationGate",
           "SLEEP_LEVELS", "WAKE_TAGS", "WEIGHT_KINDS", "HFRolloutReplica", "VLLMRolloutReplica",
           "VLLMServerReplica"]


def __getattr__(name: str):
    if name == "HFRolloutReplica":
        from weightsync.rollout.hf import HFRolloutReplica
        return HFRolloutReplica
    if name == "VLLMRolloutReplica":
        from weightsync.rollout.vllm.replica import VLLMRolloutReplica
        return VLLMRolloutReplica
    if name == "VLLMServerReplica":
        from weightsync.rollout.vllm.server_replica import VLLMServerReplica
        return VLLMServerReplica
    raise AttributeError(name)
