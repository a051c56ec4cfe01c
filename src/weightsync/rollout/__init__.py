"""Rollout side: the adapter protocol the manager drives, and the HF transformers replica.

``weightsync.rollout.hf`` imports transformers (and peft for LoRA) lazily on use.
"""

from .base import (SLEEP_LEVELS, WAKE_TAGS, WEIGHT_KINDS, Generation, GenerationGate,
                   LocalEngineRollout, RolloutAdapter)

__all__ = ["RolloutAdapter", "LocalEngineRollout", "Generation", "GenerationGate",
           "SLEEP_LEVELS", "WAKE_TAGS", "WEIGHT_KINDS", "HFRolloutReplica"]


def __getattr__(name: str):
    if name == "HFRolloutReplica":
        from .hf import HFRolloutReplica
        return HFRolloutReplica
    raise AttributeError(name)
