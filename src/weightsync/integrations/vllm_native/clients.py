"""Clients of vLLM's weight-sync control plane (vLLM's ``VLLMWeightSyncClient`` protocol).

* :class:`OfflineLLMClient` drives an offline ``vllm.LLM`` in this process (its methods
  take request objects, not the plain dicts the protocol passes).
* :class:`HTTPWeightSyncClient` drives a ``vllm serve`` process over its RL endpoints
  (``VLLM_SERVER_DEV_MODE=1``): ``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``, plus ``/pause``, ``/resume``,
  ``/weight_info``, ``/get_world_size``, ``/health`` and greedy ``/v1/completions``. Every
  request is bounded by ``timeout``; an error answer raises :class:`VLLMServerError` with
  the HTTP status, the server's message and the fields of weightsync's error marker
  (vLLM's own client raises a bare status). It lives in
  :mod:`weightsync.rollout.vllm.serve` (plain ``urllib``), shared with the server replica.
"""

from __future__ import annotations

from typing import Any, Optional

from weightsync.rollout.vllm.serve import HTTPWeightSyncClient, VLLMServerError

__all__ = ["OfflineLLMClient", "HTTPWeightSyncClient", "VLLMServerError"]


class OfflineLLMClient:
    """The weight-sync client of an offline ``vllm.LLM``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()
