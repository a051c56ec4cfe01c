"""The ``vllm.general_plugins`` entry point: registers the ``weightsync-<backend>`` engines.

pyproject.toml declares ``weightsync = "weightsync.integrations.vllm_native.plugin:register"``
in the ``vllm.general_plugins`` group, so vLLM calls :func:`register` in every one of its
processes (API server, engine core, workers) before it creates a weight-transfer engine.
Importing :mod:`weightsync.integrations.vllm_native` calls it too (a trainer process that
never loads vLLM's plugins gets the trainer-side engines that way). Safe to call again.

It does two things:

* registers ``weightsync-shm`` and ``weightsync-collective`` (and ``weightsync-nixl`` where
  ``nixl`` is installed, ``weightsync-cuda_ipc`` where CUDA is available) in vLLM's
  ``WeightTransferEngineFactory`` (worker side, lazily by module path) and
  ``WeightTransferTrainerFactory`` (trainer side);
* makes the engine core reset its prefix cache after every successful
  ``finish_weight_update`` when its backend is a weightsync one. KV blocks computed with
  the old weights would otherwise be reused by the next request sharing a prefix (vLLM's
  ``finish_weight_update`` does not reset them, and the weight-transfer engine runs in the
  worker, which cannot reach the scheduler's cache). This wraps
  ``vllm.v1.engine.core.EngineCore.collective_rpc``, the one method through which the
  offline ``LLM``, ``AsyncLLM`` (HTTP) and Ray reach the workers; other backends and other
  methods pass through untouched. Running requests are preempted if the cache cannot be
  reset otherwise (they are recomputed with the new weights).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Any

from weightsync.integrations.vllm_native.info import BACKENDS, PREFIX

__all__ = ["register", "available_backends", "install_prefix_cache_reset"]

logger = logging.getLogger(__name__)
_ENGINE = ("weightsync.integrations.vllm_native.engine", "WeightsyncWeightTransferEngine")
_TRAINER = ("weightsync.integrations.vllm_native.trainer", "WeightsyncTrainerEngine")
_MARK = "_weightsync_prefix_cache_reset"


def available_backends() -> list[str]:
    """The weightsync backends registered here (without the ``weightsync-`` prefix)."""
    out = ["shm", "collective"]
    if importlib.util.find_spec("nixl") is not None:
        out.append("nixl")
    try:
        import torch

        if torch.cuda.is_available():
            out.append("cuda_ipc")
    except Exception:  # pragma: no cover - no usable torch: no cuda_ipc
        pass
    return [b for b in BACKENDS if b in out]


def register() -> None:
    """Register every available ``weightsync-<backend>`` on both sides (idempotent)."""
    from vllm.distributed.weight_transfer.factory import (WeightTransferEngineFactory,
                                                          WeightTransferTrainerFactory)

    for name in available_backends():
        for factory, (module, cls) in ((WeightTransferEngineFactory, _ENGINE),
                                       (WeightTransferTrainerFactory, _TRAINER)):
            try:
                factory.register_engine(PREFIX + name, module, cls)
            except ValueError:       # "already registered": a second call, keep the first
                pass
    install_prefix_cache_reset()


def _is_weightsync(core: Any) -> bool:
    config = getattr(getattr(core, "vllm_config", None), "weight_transfer_config", None)
    return str(getattr(config, "backend", "")).startswith(PREFIX)


def _reset_prefix_cache(core: Any) -> None:
    if core.reset_prefix_cache():
        return
    if not core.reset_prefix_cache(reset_running_requests=True):
        raise RuntimeError("weightsync: the weights were updated but vLLM could not reset "
                           "its prefix cache")


def install_prefix_cache_reset() -> bool:
    """Wrap ``EngineCore.collective_rpc`` once (see the module docstring); True if done
    now, False if it was already wrapped or vLLM has no such engine core."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:  # pragma: no cover - another vLLM layout
        logger.warning("weightsync: no vllm.v1.engine.core.EngineCore; the prefix cache is "
                       "not reset after weight updates")
        return False
    original = EngineCore.collective_rpc
    if getattr(original, _MARK, False):
        return False

    @functools.wraps(original)
    def collective_rpc(self: Any, method: Any, timeout: Any = None, args: tuple = (),
                       kwargs: Any = None) -> Any:
        out = original(self, method, timeout, args, kwargs)
        if method == "finish_weight_update" and _is_weightsync(self):
            _reset_prefix_cache(self)
        return out

    setattr(collective_rpc, _MARK, True)
    EngineCore.collective_rpc = collective_rpc
    return True
