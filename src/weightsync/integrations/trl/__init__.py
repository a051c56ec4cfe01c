"""weightsync for TRL (1.16): the trainers' weight sync into ``vllm serve`` goes through it.

Start the server with a weightsync backend (vLLM finds it through weightsync's plugin)::

    VLLM_SERVER_DEV_MODE=1 vllm serve <model> --weight-transfer-config '{"backend": "weightsync-shm"}'

* ``GRPOTrainer`` (and the other trainers on TRL's ``VLLMGeneration``) in
  ``vllm_mode="server"``: call :func:`patch_vllm_client` once before building the trainer
  (:mod:`.client`).
* ``AsyncGRPOTrainer``: import it from here instead of ``trl.experimental.async_grpo``
  (:mod:`.trainer`): full syncs through weightsync, and TRL's adapter-only LoRA syncs
  into the server's memory (no PEFT folder); or keep TRL's class and pass
  ``weight_transfer=WeightsyncWeightTransfer(config)`` (:mod:`.transfer`).

Both run on CPU as on GPU (TRL's own NCCL path needs CUDA), bound every sync by
``weight_sync_timeout``, and leave the previous weights serving when a sync fails
(:mod:`.sync`). See docs/integrations/trl.md.
"""

from weightsync.integrations.trl.client import patch_vllm_client, unpatch_vllm_client
from weightsync.integrations.trl.sync import ServerSync, SyncAborted, SyncOptions
from weightsync.integrations.trl.trainer import adapter_tensors
from weightsync.integrations.trl.transfer import WeightsyncWeightTransfer

__all__ = ["patch_vllm_client", "WeightsyncWeightTransfer", "AsyncGRPOTrainer",
           "unpatch_vllm_client", "ServerSync", "SyncOptions", "SyncAborted",
           "WeightsyncVLLMClient", "adapter_tensors"]


def __getattr__(name: str):
    # these subclass TRL's classes: built on first use
    if name == "WeightsyncVLLMClient":
        from weightsync.integrations.trl import client

        return client.WeightsyncVLLMClient
    if name == "AsyncGRPOTrainer":
        from weightsync.integrations.trl import trainer

        return trainer.AsyncGRPOTrainer
    raise AttributeError(name)
