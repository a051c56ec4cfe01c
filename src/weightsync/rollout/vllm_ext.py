"""Old spelling of :mod:`weightsync.rollout.vllm.extension`, kept because vLLM configs name
``weightsync.rollout.vllm_ext.WeightSyncWorkerExtension`` as a string."""

from weightsync.rollout.vllm.extension import WeightSyncWorkerExtension

__all__ = ["WeightSyncWorkerExtension"]
