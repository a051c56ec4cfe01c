"""Inside a vLLM worker: check a received version and hand it to vLLM's loader.

Used by :mod:`weightsync.rollout.vllm.extension`; every function takes the vLLM worker
(``self`` of the extension) and imports vLLM lazily.

Two loaders, picked per platform (``loader="auto"``):

* ``"layerwise"`` (vLLM CPU, and any platform whose linear layers repack their weights
  after loading): one session of vLLM's layerwise reload, i.e. what
  ``Worker.reload_weights`` does (``initialize_layerwise_reload`` -> ``model.load_weights``
  -> ``finalize_layerwise_reload``), with a completeness check before the commit. A plain
  ``model.load_weights`` after start fails on CPU (the packed weights live outside the
  parameters).
* ``"direct"`` (CUDA): ``model.load_weights`` into the live parameters, then vLLM's
  post-load processing for quantized models.

Rules of the layerwise loader this module keeps (see docs/vllm-cpu-notes.md): tensors
handed to it must stay valid until their layer is complete (we hand it owned copies); a
layer whose group (q/k/v, gate/up) is incomplete at commit is silently corrupt; an unknown
name raises half way and leaves layers on the meta device. So names and shapes are checked
against the checkpoint's manifest before a tensor reaches the loader, and the whole set is
checked before the commit.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import time
from typing import Any, Iterable, Iterator, Optional

import torch

from weightsync.core.digests import box_key
from weightsync.core.errors import PlanMismatch
from weightsync.transport.tensors import partial_boxes

__all__ = ["checkpoint_header", "checkpoint_manifest", "CheckedStream", "pending_layers",
           "apply_weights", "heal_after_failure", "zero_kv_cache",
           "pick_loader"]

logger = logging.getLogger(__name__)
_MAX_HEADER = 64 << 20


def checkpoint_header(model_path: str) -> Optional[dict[str, tuple[tuple[int, ...], str]]]:
    """``{name: (shape, safetensors dtype code)}`` of the ``*.safetensors`` files of a local
    model folder (headers only, JSON), or None when it is not a folder of such files."""
    if not isinstance(model_path, str) or not os.path.isdir(model_path):
        return None
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        return None
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for fname in files:
        with open(os.path.join(model_path, fname), "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                return None
            (size,) = struct.unpack("<Q", raw)
            if size > _MAX_HEADER:
                return None
            header = json.loads(f.read(size))
        for name, meta in header.items():
            if name != "__metadata__" and isinstance(meta, dict):
                out[name] = (tuple(int(d) for d in meta.get("shape", ())),
                             str(meta.get("dtype", "")))
    return out


def checkpoint_manifest(model_path: str) -> Optional[dict[str, tuple[int, ...]]]:
    """``{name: shape}`` of :func:`checkpoint_header`, or None."""
    header = checkpoint_header(model_path)
    return None if header is None else {n: shape for n, (shape, _) in header.items()}


class CheckedStream:
    """Iterator over received ``(name, tensor)`` that rejects what the model cannot take.

    ``expected`` (``{name: shape}``) is the checkpoint's manifest, or None (no check of
    names). Every tensor is yielded as an owned copy when ``copy`` (engines yield views
    into reused buckets; vLLM's layerwise loader keeps references until a layer is
    complete). Timing of the pulls is kept in ``transport_seconds``.

    ``digest_dtype``: also hash every tensor as the loader gets it, floating ones cast to
    this dtype first (the dtype vLLM holds them in), with
    :func:`weightsync.core.digests.tensor_digest` (as the trainer side of ``verify`` does):
    ``digests``/``dtypes`` by name.

    A tensor kept in part (marked by :func:`~weightsync.transport.tensors.mark_partial`: a
    fresh tensor of the full shape whose kept boxes hold the bytes) is yielded as it is (it
    is owned already), hashed box by box (:func:`~weightsync.core.digests.box_key`), and
    counted by its boxes' bytes (``partial`` counts such tensors).
    """

    def __init__(self, items: Iterable, expected: Optional[dict], *, version: Any,
                 peer: str, copy: bool = True,
                 digest_dtype: Optional[torch.dtype] = None) -> None:
        self._items = iter(items)
        self.expected = expected
        self.version, self.peer, self.copy = version, peer, copy
        self.digest_dtype = digest_dtype
        self.digests: dict[str, str] = {}
        self.dtypes: dict[str, str] = {}
        self.seen: set[str] = set()
        self.count = self.nbytes = self.partial = 0
        self.transport_seconds = 0.0
        self._ahead: Optional[list] = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self

    def prefetch(self) -> None:
        """Take the first tensor now, before the loader opens its session: an engine that
        pulls the whole version at once (``nixl``) records what this worker keeps then,
        which runs vLLM's loaders on meta tensors (see :mod:`.slices`)."""
        if self._ahead is None:
            try:
                self._ahead = [self._take()]
            except StopIteration:
                self._ahead = []

    def __next__(self) -> tuple[str, torch.Tensor]:
        if self._ahead:
            return self._ahead.pop()
        return self._take()

    def _take(self) -> tuple[str, torch.Tensor]:
        start = time.perf_counter()
        name, tensor = next(self._items)   # StopIteration ends the stream
        if self.expected is not None:
            shape = self.expected.get(name)
            if shape is None:
                raise PlanMismatch(f"the model has no tensor named {name!r}", peer=self.peer,
                                   phase="receive", version=self.version)
            if tuple(tensor.shape) != shape:
                raise PlanMismatch(f"{name}: shape {tuple(tensor.shape)} sent, the checkpoint "
                                   f"has {shape}", peer=self.peer, phase="receive",
                                   version=self.version)
        if name in self.seen:
            raise PlanMismatch(f"{name} arrived twice", peer=self.peer, phase="receive",
                               version=self.version)
        self.seen.add(name)
        boxes = partial_boxes(tensor)
        if boxes is not None:          # kept in part: a fresh tensor, only its boxes hold bytes
            if self.digest_dtype is not None:
                for box in boxes:
                    self._digest(box_key(name, box), tensor[tuple(slice(a, b) for a, b in box)])
            self.partial += 1
            self.nbytes += sum(math.prod(b - a for a, b in box) for box in boxes) * \
                tensor.element_size()
        else:
            if self.copy:
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            if self.digest_dtype is not None:
                self._digest(name, tensor)
            self.nbytes += tensor.numel() * tensor.element_size()
        self.count += 1
        self.transport_seconds += time.perf_counter() - start
        return name, tensor

    def _digest(self, name: str, tensor: torch.Tensor) -> None:
        from weightsync.core.digests import tensor_digest
        from weightsync.core.plan import dtype_name

        held = self.digest_dtype if tensor.is_floating_point() else tensor.dtype
        t = tensor if tensor.dtype == held else tensor.to(held)
        self.digests[name] = tensor_digest(t.contiguous())
        self.dtypes[name] = dtype_name(held)

    def missing(self) -> list[str]:
        if self.expected is None:
            return []
        return sorted(set(self.expected) - self.seen)


def pick_loader(requested: str) -> str:
    if requested not in ("auto", "layerwise", "direct"):
        raise ValueError(f"loader must be 'auto', 'layerwise' or 'direct', got {requested!r}")
    if requested != "auto":
        return requested
    from vllm.platforms import current_platform

    return "layerwise" if current_platform.is_cpu() else "direct"


def pending_layers(model: torch.nn.Module) -> dict[str, list[int]]:
    """Layers of an open layerwise session that got some but not all of their elements
    (vocab embeddings are padded past the checkpoint's rows, so they are left out)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    out = {}
    for name, layer in model.named_modules():
        if isinstance(layer, VocabParallelEmbedding):
            continue
        info = LAYERWISE_INFO.get(layer)
        if info is not None and info.can_load() and \
                0 < info.load_numel < (info.load_numel_total or 0):
            out[name] = [int(info.load_numel), int(info.load_numel_total)]
    return out


#: Parameters vLLM's FP8 attention (``Fp8KVCacheMethod``) registers with defaults, which FP8
#: checkpoints do not carry (DeepSeek-V3 / Kimi-K2 style block FP8 has none): a sync need not
#: write them. Found loading such a checkpoint (every linear weight FP8 + weight_scale_inv)
#: and reloading it through ``reload_weights``: the layerwise session brings them back.
_DEFAULTED = (".attn.q_scale", ".attn.k_scale", ".attn.v_scale", ".attn.prob_scale")


def _vllm_params(worker: Any, model: torch.nn.Module) -> set[str]:
    """The parameters a sync must write (vLLM's names)."""
    lora = worker.vllm_config.lora_config is not None
    return {n.replace(".base_layer.", ".") if lora else n for n, _ in model.named_parameters()
            if not n.endswith(_DEFAULTED)}


def apply_weights(worker: Any, items: Iterable, *, loader: str, version: Any,
                  peer: str) -> dict:
    """Load ``items`` (a :class:`CheckedStream`, or a list of owned tensors) as one
    complete version; raises (without committing a half version) when it is not."""
    from vllm.config import set_current_vllm_config

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        if loader == "direct":
            loaded = set(model.load_weights(iter(items)) or ())
            _check_complete(worker, model, items, loaded, {}, version, peer)
            if worker.model_config.quantization is not None:
                from vllm.model_executor.model_loader.utils import process_weights_after_loading

                process_weights_after_loading(model, worker.model_config, worker.device)
            worker.model_runner.reset_encoder_cache()
            return {"vllm_params": len(loaded)}
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                             initialize_layerwise_reload)

        initialize_layerwise_reload(model)
        try:
            loaded = set(model.load_weights(iter(items)) or ())
            _check_complete(worker, model, items, loaded, pending_layers(model), version, peer)
        finally:
            # Always end the session: layers left on the meta device kill the engine at
            # the next forward. After a failure the caller fences the replica.
            finalize_layerwise_reload(model, worker.model_config)
    runner = worker.model_runner
    runner.reset_lora_state()       # what Worker.reload_weights does after loading
    runner.reset_encoder_cache()
    runner.reset_mm_cache()
    return {"vllm_params": len(loaded)}


def _check_complete(worker: Any, model: torch.nn.Module, items: Any, loaded: set,
                    pending: dict, version: Any, peer: str) -> None:
    missing = items.missing() if isinstance(items, CheckedStream) else []
    if missing:
        raise PlanMismatch(f"the sync left {len(missing)} tensors of the model unwritten: "
                           f"{missing[:8]}", peer=peer, phase="load", version=version)
    if pending:
        raise PlanMismatch(f"incomplete fused groups (q/k/v or gate/up): "
                           f"{dict(list(pending.items())[:4])}", peer=peer, phase="load",
                           version=version)
    unloaded = sorted(_vllm_params(worker, model) - loaded)
    if unloaded:
        raise PlanMismatch(f"vLLM parameters not loaded by the sync: {unloaded[:8]}",
                           peer=peer, phase="load", version=version)


def heal_after_failure(worker: Any) -> None:
    """End a layerwise session that a failure left open (idempotent)."""
    try:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(worker.vllm_config):
            finalize_layerwise_reload(worker.model_runner.get_model(), worker.model_config)
    except Exception:  # pragma: no cover - best effort; the replica is fenced anyway
        logger.warning("weightsync: finalize after a failed load failed", exc_info=True)


def zero_kv_cache(worker: Any) -> int:
    """Zero every KV-cache tensor (stale NaN in reused blocks survives a good reload)."""
    n = 0
    for t in getattr(worker.model_runner, "kv_caches", None) or []:
        if isinstance(t, torch.Tensor):
            t.zero_()
            n += 1
    return n
