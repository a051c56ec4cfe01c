"""vLLM rollout replica: the driver-side replica (:mod:`.replica`, :mod:`.driver`), the
worker extension hosted in every vLLM worker (:mod:`.extension`, :mod:`.apply`,
:mod:`.checks`) and options (:mod:`.util`). vLLM itself is imported lazily.
"""

from weightsync.rollout.vllm.replica import VLLMRolloutReplica
from weightsync.rollout.vllm.util import VLLMOptions, model_folder_from_config

__all__ = ["VLLMRolloutReplica", "VLLMOptions", "model_folder_from_config"]
