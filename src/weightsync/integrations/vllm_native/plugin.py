"""The ``vllm.general_plugins`` entry point: registers the ``weightsync-<backend>`` engines.

pyproject.toml declares ``weightsync = "weightsync.integrations.vllm_native.plugin:register"``
in the ``vllm.general_plugins`` group, so vLLM calls :func:`register` in every one of its
processes (API server, engine core, workers) before it creates a weight-transfer engine.
Importing :mod:`weightsync.integrations.vllm_native` calls it too (a trainer process that
never loads vLLM's plugins gets the trainer-side engines that way). Safe to call again.

It does these things:

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
  reset otherwise (they are recomputed with the new weights);
* lets vLLM's LoRA manager build adapters from tensors weightsync holds in memory
  (``lora_path`` ``weightsync-mem:<name>@<version>``, :mod:`weightsync.rollout.vllm.lora`),
  so an adapter-only sync never writes a PEFT folder (:func:`install_memory_adapters`);
* answers bad HTTP input to the weight-transfer endpoints with a 4xx instead of vLLM's
  blanket 500 (:func:`install_http_statuses`). vLLM's RPC from the workers keeps only an
  error's text, so the worker side (:mod:`.engine`) appends weightsync's error marker
  (type, HTTP status, peer, phase, version) to it; in the API server the weight-transfer
  methods of ``AsyncLLM`` (``init_weight_transfer_engine``, ``start_weight_update``,
  ``update_weights``, ``finish_weight_update``, ``shutdown_weight_transfer_engine``) re-raise
  a marked failure as vLLM's ``GracefulHTTPError`` with that status and the worker's own
  message (marker kept, so clients can rebuild the error): 400 malformed init or update
  info, 403 a token the trainer's store refused, 409 calls out of order, 422 a weight set
  that does not fit the model; failures of a transfer stay 500. vLLM's own out-of-order
  errors of its worker (update without start, ...) carry no marker; for a weightsync
  backend they are recognised by their text and answered 409 as well.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
from typing import Any

from weightsync.integrations.vllm_native.info import BACKENDS, PREFIX
from weightsync.rollout.vllm.serve import ERROR_STATUS, error_fields

__all__ = ["register", "available_backends", "install_prefix_cache_reset",
           "install_http_statuses", "install_memory_adapters", "http_error"]

logger = logging.getLogger(__name__)
_ENGINE = ("weightsync.integrations.vllm_native.engine", "WeightsyncWeightTransferEngine")
_TRAINER = ("weightsync.integrations.vllm_native.trainer", "WeightsyncTrainerEngine")
_MARK = "_weightsync_prefix_cache_reset"
_HTTP_MARK = "_weightsync_http_statuses"
_HTTP_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                 "finish_weight_update", "shutdown_weight_transfer_engine")
#: vLLM 0.32's own worker errors for weight-transfer calls out of order (no marker).
_VLLM_SESSION = ("start_weight_update must be called before update_weights",
                 "finish_weight_update called without a matching start_weight_update",
                 "start_weight_update called while a weight update is already active",
                 "Cannot release a trainer connection during a weight update")
_WORKER_TEXT = re.compile(r"Worker failed with error '(.*)', please check the stack trace",
                          re.S)


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
    install_http_statuses()
    install_memory_adapters()


def install_memory_adapters() -> bool:
    """Let vLLM's LoRA manager load adapters weightsync holds in memory
    (:mod:`weightsync.rollout.vllm.lora`); False where this vLLM lacks the internals."""
    from weightsync.rollout.vllm import lora

    try:
        return lora.install()
    except RuntimeError as exc:
        logger.warning("weightsync: %s; adapters are loaded from folders only", exc)
        return False


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


def http_error(exc: BaseException, weightsync_backend: bool = True) -> Any:
    """The ``GracefulHTTPError`` to answer ``exc`` (a failed weight-transfer call, as the
    API server sees it) with, or None to keep vLLM's answer (500)."""
    text = str(exc)
    fields = error_fields(text)
    if fields is not None:
        status = int(fields.get("status") or ERROR_STATUS.get(fields["type"], 500))
    elif weightsync_backend and any(m in text for m in _VLLM_SESSION):
        status = ERROR_STATUS["SessionStateError"]
    else:
        return None
    if not 400 <= status < 500:
        return None
    from http import HTTPStatus

    from vllm.exceptions import GracefulHTTPError

    inner = _WORKER_TEXT.search(text)
    return GracefulHTTPError(inner.group(1) if inner else text, HTTPStatus(status))


def _engine_is_weightsync(engine: Any) -> bool:
    config = getattr(getattr(engine, "vllm_config", None), "weight_transfer_config", None)
    return str(getattr(config, "backend", "")).startswith(PREFIX)


def _answering(original: Any) -> Any:
    @functools.wraps(original)
    async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await original(self, *args, **kwargs)
        except Exception as exc:
            answer = http_error(exc, _engine_is_weightsync(self))
            if answer is None:
                raise
            raise answer from exc
    return method


def install_http_statuses() -> bool:
    """Wrap ``AsyncLLM``'s weight-transfer methods once (see the module docstring); True
    if done now, False if already done or this vLLM has no ``AsyncLLM``."""
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:  # pragma: no cover - another vLLM layout
        return False
    if getattr(AsyncLLM, _HTTP_MARK, False):
        return False
    for name in _HTTP_METHODS:
        original = getattr(AsyncLLM, name, None)
        if original is not None:
            setattr(AsyncLLM, name, _answering(original))
    setattr(AsyncLLM, _HTTP_MARK, True)
    return True
