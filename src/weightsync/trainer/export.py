"""Turn a trainer model into the stream of named tensors a rollout expects (HF names).

:func:`export_weights` handles a plain ``nn.Module``, an FSDP2 model (``fully_shard``,
DTensor parameters) and a PEFT LoRA model, with an optional cast. It is a lazy generator:
tensors are produced one at a time as the checkpoint engine consumes them, so no rank
ever holds more than one full tensor of the model (plus the engine's buckets).

FSDP2: every tensor gets one *owner* among the ranks of the export group, picked by a
balanced assignment (largest tensor first to the least loaded rank), identical on every
rank. Sharded parameters move in exchanges of up to ``coalesce_bytes``: one
``all_to_all`` per exchange in which every rank sends each owner its shards of the tensors
that owner owns (:mod:`.fsdp`); only the owner assembles and yields a tensor. So each
rank sends about ``1/world`` of the bytes, no tensor is gathered twice, no rank holds
more than its share of one exchange, and a model of N tensors needs about
``size / coalesce_bytes`` collectives instead of N. Every rank must iterate its generator
to the end (the exchanges are collectives), which the engines do.

``kind``:

* ``"full"``: every tensor of the model under its HF name. For a PEFT model this is the
  merged model (``W + B @ A * scaling`` per LoRA layer, as PEFT merges), computed into new
  tensors: the trainer's model is left bit-identical (``"merged"`` is an alias).
* ``"base"``: a PEFT model's base weights, unmerged, under HF names.
* ``"adapter"``: a PEFT model's LoRA tensors only, under PEFT's file names (as
  ``get_peft_model_state_dict`` writes them); pair with :func:`lora_config_dict`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from weightsync.transport.tensors import mark_stable
from weightsync.trainer.fsdp import (coalescible, dist_rank_world, gather_many_to_owners, gather_to_owner,
                   is_dtensor)
from weightsync.trainer.lora import (active_adapter, adapter_name, check_supported, hf_name, is_lora_param,
                   is_peft_model, lora_delta, lora_linears)

__all__ = ["ExportItem", "plan_export", "export_weights", "assign_owners", "KINDS"]

KINDS = ("full", "merged", "base", "adapter")


@dataclass(frozen=True)
class ExportItem:
    """One exported tensor: built from ``sources`` (by ``combine`` when there are several)."""

    name: str
    sources: tuple
    nbytes: int
    combine: Optional[Callable[[list], torch.Tensor]] = None


def _unique_state(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """State-dict entries (parameters and persistent buffers), tied tensors once."""
    seen, out = set(), []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out.append((name, t))
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_export(model: torch.nn.Module, kind: str = "full") -> list[ExportItem]:
    """The export items of ``model`` for ``kind``, in model order (same on every rank)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    state = _unique_state(model)
    if not is_peft_model(model):
        if kind == "adapter":
            raise ValueError("kind='adapter' needs a PEFT model; this model has no LoRA adapter")
        return [ExportItem(n, (t,), _nbytes(t)) for n, t in state]
    check_supported([n for n, _ in state])
    adapter = active_adapter(model)
    by_name = dict(state)
    if kind == "adapter":
        return [ExportItem(adapter_name(n, adapter), (t,), _nbytes(t)) for n, t in state
                if is_lora_param(n) and f".{adapter}." in n]
    layers = lora_linears(model, adapter) if kind in ("full", "merged") else {}
    items = []
    for name, t in state:
        if is_lora_param(name):
            continue
        module = name[: -len(".base_layer.weight")] if name.endswith(".base_layer.weight") else None
        info = layers.get(module) if module else None
        if info is None:
            items.append(ExportItem(hf_name(name), (t,), _nbytes(t)))
            continue
        a = by_name[f"{module}.lora_A.{adapter}.weight"]
        b = by_name[f"{module}.lora_B.{adapter}.weight"]

        def merge(parts, info=info):
            w, wa, wb = parts
            return w + lora_delta(info, wa, wb).to(w.dtype)

        items.append(ExportItem(hf_name(name), (t, a, b), _nbytes(t), merge))
    return items


def assign_owners(items: list[ExportItem], ranks: list[int]) -> list[int]:
    """Balanced, deterministic owner (global rank) of each item: largest first to the least
    loaded rank (ties: lower rank, then model order)."""
    load = {r: 0 for r in ranks}
    owners = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda k: (-items[k].nbytes, k)):
        r = min(ranks, key=lambda k: (load[k], k))
        load[r] += max(items[i].nbytes, 1)
        owners[i] = r
    return owners


def _chunks(items: list[ExportItem], limit: int) -> Iterator[range]:
    """Consecutive runs of items of at most ``limit`` bytes (at least one item each)."""
    start, size = 0, 0
    for i, item in enumerate(items):
        if i > start and size + item.nbytes > limit:
            yield range(start, i)
            start, size = i, 0
        size += item.nbytes
    if start < len(items):
        yield range(start, len(items))


def _materialize(t: torch.Tensor, owner: int, me: int,
                 dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    if not t.is_floating_point():
        dtype = None
    if is_dtensor(t):
        return gather_to_owner(t.data if isinstance(t, torch.nn.Parameter) else t, owner, dtype)
    if me != owner:
        return None
    t = t.detach()
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def _cast(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    if dtype is None or t.dtype == dtype or not t.is_floating_point():
        return t
    return t.to(dtype)


def export_weights(model: torch.nn.Module, *, kind: str = "full",
                   dtype: Optional[torch.dtype] = None,
                   group: Optional[dist.ProcessGroup] = None,
                   owner: Optional[int] = None,
                   coalesce_bytes: int = 16 << 20,
                   shards: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` of ``model`` owned by this rank (see module docstring).

    ``shards``: for backends that serve shards as they are (``"shards"`` in their
    capabilities, e.g. ``nixl``): every rank yields every tensor, an FSDP2 parameter as
    its DTensor (this rank's shard; cast shard-wise), no gather; a tensor built from several
    sources (a merged LoRA layer) is built in full on every rank.

    ``group``: the ranks that share the export (default: the whole world when
    ``torch.distributed`` is initialized). ``owner``: put every tensor on this one global
    rank instead of spreading them (e.g. to build a full copy on rank 0).
    ``coalesce_bytes``: sharded tensors move in exchanges of up to this many bytes (one
    collective each instead of one per tensor); an owner holds at most its share of one
    exchange at a time.
    """
    if isinstance(coalesce_bytes, bool) or not isinstance(coalesce_bytes, int) \
            or coalesce_bytes < 1:
        raise ValueError(f"coalesce_bytes must be an int >= 1, got {coalesce_bytes!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    items = plan_export(model, kind)
    if shards:
        yield from _export_shards(items, dtype)
        return
    me, _, ranks = dist_rank_world(group)
    if owner is not None and owner not in ranks:
        raise ValueError(f"owner {owner} is not a rank of the export group {ranks}")
    owners = [owner] * len(items) if owner is not None else assign_owners(items, ranks)
    for chunk in _chunks(items, coalesce_bytes):
        parts = _materialize_chunk([items[i] for i in chunk], [owners[i] for i in chunk],
                                   me, ranks, dtype)
        for k, i in enumerate(chunk):
            srcs, parts[k] = parts[k], None     # free each tensor once it is handed over
            if owners[i] != me:
                continue
            item = items[i]
            with torch.no_grad():  # not held across the yield: grad mode is thread state
                out = _cast(item.combine(srcs) if item.combine is not None else srcs[0], dtype)
            del srcs
            yield item.name, out


def _export_shards(items: list[ExportItem], dtype: Optional[torch.dtype]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    for item in items:
        with torch.no_grad():
            if item.combine is None:
                src = item.sources[0]
                out = _cast(src.detach(), dtype)
                if out.dtype == src.dtype:       # a view of the parameter: kept across syncs
                    mark_stable(out)
            else:   # the same collectives in the same order on every rank
                out = _cast(item.combine([s.full_tensor() if is_dtensor(s) else s
                                          for s in item.sources]), dtype)
        yield item.name, out


def _materialize_chunk(items: list[ExportItem], owners: list[int], me: int, ranks: list[int],
                       dtype: Optional[torch.dtype]) -> list[list]:
    """Every source of ``items`` on its item's owner (None elsewhere). Sharded sources on a
    mesh spanning the export group move in one ``all_to_all``; the rest one by one, in the
    same order on every rank."""
    out: list[list] = [[None] * len(item.sources) for item in items]
    batch, rest = [], []
    for i, item in enumerate(items):
        cast = dtype if item.combine is None else None
        for j, src in enumerate(item.sources):
            group = coalescible(src)
            cast_j = cast if src.is_floating_point() else None
            if group is not None and dist.get_process_group_ranks(group) == ranks:
                batch.append((i, j, src, cast_j, group))
            else:
                rest.append((i, j, src, cast_j))
    with torch.no_grad():
        if batch:
            full = gather_many_to_owners([b[2] for b in batch], [owners[b[0]] for b in batch],
                                         [b[3] for b in batch], batch[0][4])
            for (i, j, *_), t in zip(batch, full):
                out[i][j] = t
        for i, j, src, cast_j in rest:
            out[i][j] = _materialize(src, owners[i], me, cast_j)
    return out
