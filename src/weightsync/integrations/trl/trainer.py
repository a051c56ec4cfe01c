"""TRL's ``AsyncGRPOTrainer`` with every sync through weightsync, LoRA adapters in memory.

A one-line change of a TRL script::

    from weightsync.integrations.trl import AsyncGRPOTrainer   # was: from trl.experimental.async_grpo

It is TRL 1.16's ``trl.experimental.async_grpo.AsyncGRPOTrainer`` with two things swapped:

* full (or merged) weight syncs go through :class:`~.transfer.WeightsyncWeightTransfer`
  instead of TRL's NCCL client (on CPU too);
* TRL's adapter-only sync (a PEFT model and a server started with ``--enable-lora``:
  TRL decides it exactly as without weightsync, ``select_adapter_sync``) streams the
  adapter's tensors into the server's memory and loads them with vLLM's LoRA API
  (:meth:`~.sync.ServerSync.send_adapter`), where TRL writes a PEFT folder under
  ``output_dir`` that the server must be able to read. Names and versions stay TRL's own
  (``trl-policy-v<N>``, the stale ones unloaded after ``max_staleness``), so TRL's rollout
  worker requests them unchanged; the server needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``
  as with TRL's own adapter sync.

``weight_transfer=`` given: TRL's behaviour (that object syncs merged weights). The
weightsync options go in ``weightsync={"backend": ..., "bucket_size": ..., ...}`` (see
:class:`~.transfer.WeightsyncWeightTransfer`); ``weight_sync_timeout`` and the server's
URL come from the trainer's config.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from weightsync.integrations.trl.transfer import WeightsyncWeightTransfer

__all__ = ["AsyncGRPOTrainer", "adapter_tensors"]

logger = logging.getLogger(__name__)


def adapter_tensors(model: torch.nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's file names (``base_model.model....lora_A.weight``),
    sharded ones gathered (``full_tensor()``: a collective, so every rank calls this)."""
    from peft import get_peft_model_state_dict
    from torch.distributed.tensor import DTensor

    state = get_peft_model_state_dict(model, adapter_name=adapter)
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach()
            for name, t in state.items()}


def _base() -> type:
    from trl.experimental.async_grpo import AsyncGRPOTrainer as TRLAsyncGRPOTrainer

    return TRLAsyncGRPOTrainer


class _Mixin:
    """What :class:`AsyncGRPOTrainer` adds to TRL's (see the module docstring)."""

    def __init__(self, *args: Any, weight_transfer: Any = None,
                 weightsync: Optional[dict] = None, **kwargs: Any) -> None:
        own = weight_transfer is None
        super().__init__(*args, weight_transfer=weight_transfer, **kwargs)
        self.weightsync: Optional[WeightsyncWeightTransfer] = None
        if own and self.accelerator.is_main_process:
            self.weightsync = WeightsyncWeightTransfer(self.args, **dict(weightsync or {}))
            if not self._lora_sync:      # TRL built its NCCL client (unused): ours instead
                self.weight_transfer = self.weightsync

    def _sync_weight_lora(self, t0: float) -> tuple[float, float, float]:
        """TRL's adapter-only sync with the adapter moved through weightsync into the
        server's memory (no folder); the phases and metrics are TRL's."""
        version = self.model_version + 1
        name = f"{self._lora_name}-v{version}"
        model = self.accelerator.unwrap_model(self.model)
        main = self.accelerator.is_main_process
        if main:
            self.vllm_client.pause()
        t_pause = time.time()
        self.accelerator.wait_for_everyone()
        t_barrier = time.time()
        tensors = adapter_tensors(model, self._adapter_name)     # every rank: may gather
        if main:
            from weightsync.trainer.lora import lora_config_dict

            try:
                self.weightsync.sync.send_adapter(
                    tensors, lora_config_dict(model, self._adapter_name), name=name,
                    version=version)
            except Exception as exc:
                try:
                    self.vllm_client.resume()
                    exc.add_note(f"the vLLM server was resumed: it generates with the "
                                 f"adapters it had ({self._lora_name}-v{version - 1} and older)")
                except Exception as again:
                    exc.add_note(f"resuming the vLLM server failed too ({again})")
                raise
        t_transfer = time.time()
        self.accelerator.wait_for_everyone()
        if main:
            self.vllm_client.resume()
            stale = version - (self.args.max_staleness + 1)
            if stale > 0:
                self.vllm_client.unload_lora_adapter(f"{self._lora_name}-v{stale}")
            self.model_version = version
            if self.rollout_worker:
                self.rollout_worker.update_model_version(self.model_version)
        return t_pause, t_barrier, t_transfer

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._inner_training_loop(*args, **kwargs)
        finally:
            if self.weightsync is not None and self.weightsync is not self.weight_transfer:
                self.weightsync.destroy()


_CLASS: Optional[type] = None


def __getattr__(name: str) -> Any:
    if name == "AsyncGRPOTrainer":        # subclasses TRL's class: built on first use
        global _CLASS
        if _CLASS is None:
            _CLASS = type("AsyncGRPOTrainer", (_Mixin, _base()),
                          {"__module__": __name__, "__doc__": __doc__})
        return _CLASS
    raise AttributeError(name)
