"""Which slice of every checkpoint tensor a vLLM worker keeps, learned from vLLM's own
weight loaders.

A tensor-parallel vLLM worker keeps a part of most tensors: its rows of a column-parallel
weight, its columns of a row-parallel one, its heads of ``q``/``k``/``v`` fused into
``qkv_proj``, its share of the (padded) vocabulary. Which part is decided by the model's
``load_weights`` and the layers' ``weight_loader`` functions, for every architecture vLLM
has. :func:`record_slices` runs exactly those loaders once per checkpoint tensor against a
*recording* tensor on the meta device, with the model's parameters swapped for meta
tensors in vLLM's model format (the metadata vLLM keeps for reloading), under a dispatch
mode that sees every ``copy_`` into a parameter. The view arithmetic of the loader
(``narrow``, slicing, ``chunk``, ``select``) is carried by the meta tensors' offsets and
strides, so each copy is turned into a box (a ``(start, stop)`` per dimension) of the
source tensor. No byte moves and no parameter changes: the swapped parameters are put
back afterwards.

A tensor whose loader does anything the recorder cannot map back to a box of the source
(a copy from a transformed tensor: a cast, a concatenation, a transpose made contiguous;
a broadcast; ``item()``; an op the meta device lacks) is kept whole, and
:class:`~weightsync.core.xferplan.Keep` says so in its notes: the loader then gets the
full tensor at every sync, as without slices.

At a sync, the worker pulls only those boxes (``nixl``) and hands vLLM's loader a tensor
of the checkpoint's full shape whose kept boxes hold the version's bytes (the rest is
never read by that worker's loader: that is what was recorded). Used by
:mod:`weightsync.rollout.vllm.extension` in the vLLM worker.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from weightsync.core.plan import dtype_from_name
from weightsync.core.xferplan import Keep

__all__ = ["record_slices", "box_of_view"]

logger = logging.getLogger(__name__)
Box = tuple[tuple[int, int], ...]


class Unrecordable(Exception):
    """A loader step that does not map to a box of the source tensor."""


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _strides(shape: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(int(d), 1)
    return out[::-1]


def box_of_view(view: torch.Tensor, base_shape: Sequence[int]) -> Box:
    """The box of a contiguous tensor of ``base_shape`` that ``view`` (a strided view of
    it, its dimensions in the base's order) covers; :class:`Unrecordable` otherwise."""
    base_shape = tuple(int(d) for d in base_shape)
    strides = _strides(base_shape)
    start, rem = [], int(view.storage_offset())
    for st in strides:
        start.append(rem // st)
        rem %= st
    ext, j = [1] * len(base_shape), 0
    for size, st in zip(view.shape, view.stride()):
        if size == 1:
            continue
        while j < len(base_shape) and not (strides[j] == st and base_shape[j] > 1):
            j += 1
        if j == len(base_shape):
            raise Unrecordable(f"a view with strides {tuple(view.stride())} of a tensor "
                               f"{base_shape} is not a box (transposed or broadcast)")
        ext[j] = int(size)
        j += 1
    box = tuple((a, a + e) for a, e in zip(start, ext))
    if any(b > d for (_, b), d in zip(box, base_shape)) or \
            math.prod(ext) != view.numel() or not base_shape and view.numel() != 1:
        raise Unrecordable(f"a view of a tensor {base_shape} at offset "
                           f"{view.storage_offset()} falls outside it")
    return box


def _squeezed(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape if d != 1)


class _Recorder(TorchDispatchMode):
    """Records ``copy_`` from views of registered sources into registered parameters;
    mutating ops on real (non-meta) tensors are not run."""

    def __init__(self, params: dict[int, tuple[str, tuple]]) -> None:
        super().__init__()
        self.params = params
        self.sources: dict[int, tuple[str, tuple]] = {}
        self.derived: set[int] = set()
        self.copies: list[tuple[str, Box, str, Box]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        keys = [_key(a) for a in tensors]
        touches = any(k in self.sources or k in self.derived for k in keys)
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            param = self.params.get(_key(dst))
            source = self.sources.get(_key(src))
            if param is not None and source is not None:
                if _squeezed(dst) != _squeezed(src):
                    raise Unrecordable(f"{param[0]} takes a broadcast of {source[0]}")
                self.copies.append((param[0], box_of_view(dst, param[1]), source[0],
                                    box_of_view(src, source[1])))
                return dst
            if touches:
                raise Unrecordable(f"a copy from a transformed {self._what(keys)} "
                                   f"into {'parameter ' + param[0] if param else 'a tensor'}")
        if func._schema.is_mutable and any(not t.is_meta for t in tensors):
            if touches:
                raise Unrecordable(f"{func} writes a source into a tensor")
            return args[0] if args and isinstance(args[0], torch.Tensor) else None
        out = func(*args, **kwargs)
        if touches:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and _key(t) not in self.sources:
                    self.derived.add(_key(t))
        return out

    def _what(self, keys: list[int]) -> str:
        names = [self.sources[k][0] for k in keys if k in self.sources]
        return names[0] if names else "source"


class _MetaParameters:
    """Context: every layer with reload metadata has its parameters swapped for meta
    tensors in vLLM's model format (as vLLM's layerwise reload does); put back on exit."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.saved: list[tuple] = []
        self.loaders: list[tuple[torch.Tensor, Any]] = []

    def _unwrap(self, p: Any) -> None:
        """The metadata tensors keep the wrapper a past layerwise reload put on their
        loader (it loads nothing outside a reload session): run the loader under it."""
        loader = getattr(p, "weight_loader", None) if p is not None else None
        if loader is None or getattr(loader, "__name__", "") != "online_process_loader":
            return
        self.loaders.append((p, loader))
        while getattr(loader, "__name__", "") == "online_process_loader":
            loader = loader.__wrapped__
        p.weight_loader = loader

    def __enter__(self) -> "_MetaParameters":
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta

        try:
            for layer in self.model.modules():
                info = LAYERWISE_INFO.get(layer)
                if info is None or not any(info.restore_metadata):
                    continue
                self.saved.append((layer, dict(layer._parameters), dict(layer._buffers),
                                   set(layer._non_persistent_buffers_set),
                                   {k: v for k, v in vars(layer).items()
                                    if isinstance(v, torch.Tensor)}))
                restore_layer_on_meta(layer, info)
                for p in layer._parameters.values():
                    self._unwrap(p)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for p, loader in reversed(self.loaders):
            p.weight_loader = loader
        self.loaders = []
        for layer, params, buffers, non_persistent, attrs in reversed(self.saved):
            layer._parameters.clear()
            layer._parameters.update(params)
            layer._buffers.clear()
            layer._buffers.update(buffers)
            layer._non_persistent_buffers_set = non_persistent
            for k in [k for k, v in vars(layer).items() if isinstance(v, torch.Tensor)]:
                if k not in attrs:
                    object.__delattr__(layer, k)
            for k, v in attrs.items():
                object.__setattr__(layer, k, v)
        self.saved = []


def _merge(boxes: Iterable[Box]) -> tuple[Box, ...]:
    """Distinct boxes, one dropped when another contains it, in first-seen order."""
    out: list[Box] = []
    for b in boxes:
        if any(all(oa <= a and b2 <= ob for (a, b2), (oa, ob) in zip(b, o)) for o in out):
            continue
        out = [o for o in out if not all(a <= oa and ob <= b2 for (a, b2), (oa, ob) in zip(b, o))]
        out.append(b)
    return tuple(out)


def record_slices(worker: Any, tensors: Sequence[tuple[str, Sequence[int], str]]) -> Keep:
    """What this vLLM worker's loaders read of each of ``tensors`` (``(name, shape,
    dtype)`` as a trainer serves them), as a :class:`~weightsync.core.xferplan.Keep`
    (see the module doc). Runs in the vLLM worker, between steps."""
    from vllm.config import set_current_vllm_config

    model = worker.model_runner.get_model()
    boxes: dict[str, tuple[Box, ...]] = {}
    full: dict[str, str] = {}
    written: set[str] = set()
    with set_current_vllm_config(worker.vllm_config), torch.no_grad(), _MetaParameters(model):
        params = {_key(p): (n, tuple(int(d) for d in p.shape))
                  for n, p in model.named_parameters(remove_duplicate=False)}
        for name, shape, dtype in tensors:
            shape = tuple(int(d) for d in shape)
            whole = tuple((0, d) for d in shape)
            src = torch.empty(shape, dtype=dtype_from_name(dtype), device="meta")
            rec = _Recorder(params)
            rec.sources[_key(src)] = (name, shape)
            try:
                with rec:
                    model.load_weights(iter([(name, src)]))
            except Exception as exc:   # Unrecordable, or the meta device refused an op
                full[name] = f"{type(exc).__name__}: {exc}"[:200]
                continue
            kept = _merge(b for _, _, n, b in rec.copies if n == name)
            written.update(p for p, _, _, _ in rec.copies)
            if kept != (whole,):
                boxes[name] = kept
        unwritten = sorted({n for n, _ in params.values()} - written)
    notes = tuple(f"full pull of {n}: its loader could not be recorded ({why})"
                  for n, why in full.items())
    if unwritten and not full:
        # a parameter no recorded copy wrote, and no tensor pulled whole that could: the
        # recording missed something, so nothing is sliced
        logger.warning("weightsync: vLLM worker %s: no recorded load writes %s; every "
                       "tensor is pulled whole", getattr(worker, "rank", "?"), unwritten[:8])
        return Keep(notes=(f"every tensor pulled whole: no recorded load writes "
                           f"{unwritten[:8]}",))
    logger.info("weightsync: vLLM worker %s keeps slices of %d of %d tensors (%d kept whole "
                "because their loader could not be recorded)", getattr(worker, "rank", "?"),
                len(boxes), len(tensors), len(full))
    return Keep(boxes=boxes, notes=notes)
