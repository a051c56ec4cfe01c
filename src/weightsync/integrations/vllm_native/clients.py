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
* :func:`load_adapter` and :func:`reset_prefix_cache` load a LoRA adapter (a folder or a
  weightsync memory path) and drop the prefix cache through either client (offline
  ``add_lora``; ``/v1/load_lora_adapter`` and ``/reset_prefix_cache`` over HTTP).
"""

from __future__ import annotations

from typing import Any, Optional

from weightsync.rollout.vllm.serve import HTTPWeightSyncClient, VLLMServerError

__all__ = ["OfflineLLMClient", "HTTPWeightSyncClient", "VLLMServerError", "load_adapter",
           "reset_prefix_cache"]


class OfflineLLMClient:
    """The weight-sync client of an offline ``vllm.LLM``; it also loads adapters by name
    (:meth:`load_lora_adapter`) and gives their ``LoRARequest`` for ``generate``
    (:meth:`lora_request`)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._lora_ids: dict[str, int] = {}
        self._loras: dict[str, Any] = {}

    def load_lora_adapter(self, name: str, path: str, load_inplace: bool = True) -> None:
        """Load (or reload in place) adapter ``name`` from ``path`` (a folder, or a
        weightsync memory path)."""
        from vllm.lora.request import LoRARequest

        lora_id = self._lora_ids.setdefault(name, len(self._lora_ids) + 1)
        self.llm.llm_engine.add_lora(LoRARequest(name, lora_id, path,
                                                 load_inplace=load_inplace))
        self._loras[name] = LoRARequest(name, lora_id, path)

    def lora_request(self, name: str) -> Any:
        """The ``LoRARequest`` to pass to ``generate`` for the adapter loaded as ``name``."""
        if name not in self._loras:
            raise KeyError(f"no adapter {name!r} was loaded through this client")
        return self._loras[name]

    def reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            self.llm.reset_prefix_cache(reset_running_requests=True)

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


def load_adapter(client: Any, name: str, path: str, *, load_inplace: bool = True) -> None:
    """Load adapter ``name`` from ``path`` through ``client``: its
    ``load_lora_adapter(name, path, load_inplace)``, or vLLM's ``/v1/load_lora_adapter``
    for an HTTP client (the server needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``)."""
    own = getattr(client, "load_lora_adapter", None)
    if callable(own):
        own(name, path, load_inplace=load_inplace)
        return
    request = getattr(client, "request", None)
    if not callable(request):
        raise TypeError(f"{type(client).__name__} can neither load_lora_adapter nor send an "
                        "HTTP request; it cannot load an adapter")
    try:
        request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path,
                                                  "load_inplace": bool(load_inplace)})
    except VLLMServerError as exc:
        if exc.status == 404:
            raise ValueError("the vLLM server does not serve /v1/load_lora_adapter: start it "
                             "with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (and --enable-lora)") \
                from None
        raise


def reset_prefix_cache(client: Any) -> None:
    """Drop the prefix cache through ``client`` (its own method, or ``/reset_prefix_cache``)."""
    own = getattr(client, "reset_prefix_cache", None)
    if callable(own):
        own()
        return
    request = getattr(client, "request", None)
    if callable(request):
        request("POST", "/reset_prefix_cache")
