"""weightsync for TRL (1.16): the trainers' weight sync into ``vllm serve`` goes through it.

Start the server with a weightsync backend (vLLM finds it through weightsync's plugin)::

    VLLM_SERVER_DEV_MODE=1 vllm serve <model> --weight-transfer-config '{"backend": "weightsync-shm"}'

* ``GRPOTrainer`` (and the other trainers on TRL's ``VLLMGeneration``) in
  ``vllm_mode="server"``: call :func:`patch_vllm_client` once before building the trainer
  (:mod:`.client`).
* ``AsyncGRPOTrainer``: pass ``weight_transfer=WeightsyncWeightTransfer(config)``
  (:mod:`.transfer`).

Both run on CPU as on GPU (TRL's own NCCL path needs CUDA), bound every sync by
``weight_sync_timeout``, and leave the previous weights serving when a sync fails
(:mod:`.sync`). See docs/integrations/trl.md.
"""

from weightsync.integrations.trl.client import patch_vllm_client, unpatch_vllm_client
from weightsync.integrations.trl.sync import ServerSync, SyncAborted, SyncOptions
from weightsync.integrations.trl.transfer import WeightsyncWeightTransfer

__all__ = ["patch_vllm_client", "WeightsyncWeightTransfer", "unpatch_vllm_client",
           "ServerSync", "SyncOptions", "SyncAborted", "WeightsyncVLLMClient"]


def __getattr__(name: str):
    if name == "WeightsyncVLLMClient":     # subclasses TRL's class: built on first use
        from weightsync.integrations.trl import client

        return client.WeightsyncVLLMClient
    raise AttributeError(name)
