"""Materialize FSDP2 (DTensor) parameters one at a time on one owning rank.

``DTensor.full_tensor()`` all-gathers: every rank ends up holding every full tensor. For
export only one rank needs each tensor, so :func:`gather_to_owner` does a ``gather`` to
the owner instead: each rank sends its (padded) shard, only the owner allocates the full
tensor, and the others get ``None``. Every rank must call it for the same tensors in the
same order (it is a collective on the DTensor's mesh group). Layouts other than a 1-D
mesh with one ``Shard`` placement fall back to ``full_tensor()`` on every rank.
:func:`gather_many_to_owners` moves many such tensors in one ``all_to_all``; both send
the same padded shards (``_padded_shard``).

Called by :mod:`weightsync.trainer.export` only.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["is_dtensor", "gather_to_owner", "gather_many_to_owners", "coalescible",
           "dist_rank_world"]


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" or (
        isinstance(t, torch.nn.Parameter) and type(t.data).__name__ == "DTensor")


def dist_rank_world(group: Optional[dist.ProcessGroup] = None) -> tuple[int, int, list[int]]:
    """(global rank, size of ``group``, global ranks of ``group``); (0, 1, [0]) without dist."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, [0]
    group = group or dist.group.WORLD
    return dist.get_rank(), dist.get_world_size(group), dist.get_process_group_ranks(group)


def _chunk_sizes(n: int, world: int) -> tuple[int, list[int]]:
    """``torch.chunk`` semantics, which DTensor's ``Shard`` follows."""
    size = -(-n // world) if n else 0
    return size, [max(0, min(size, n - r * size)) for r in range(world)]


def _fallback(dt: torch.Tensor, owner: int, dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    full = dt.full_tensor()
    if dist.get_rank() != owner:
        return None
    return full if dtype is None or full.dtype == dtype else full.to(dtype)


def _padded_shard(dt: torch.Tensor, world: int, index: int,
                  dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, int, int, tuple]:
    """This rank's (the ``index``-th of ``world``) shard of ``dt``, cast to ``dtype``, with
    the sharded dim moved first and zero-padded to the chunk size every rank sends:
    ``(contiguous shard, dim, chunk size, shape of the other dims)``."""
    dim = dt.placements[0].dim % max(dt.dim(), 1)
    size, sizes = _chunk_sizes(dt.shape[dim], world)
    local = dt.to_local()
    if dtype is not None and local.dtype != dtype:
        local = local.to(dtype)
    moved = local.movedim(dim, 0) if dim else local
    if moved.shape[0] != sizes[index]:
        raise RuntimeError(f"unexpected shard of {tuple(dt.shape)} on rank {dist.get_rank()}: "
                           f"{tuple(local.shape)} (expected {sizes[index]} along dim {dim})")
    rest = tuple(moved.shape[1:])
    if moved.shape[0] < size:
        pad = torch.zeros((size - moved.shape[0],) + rest, dtype=moved.dtype, device=moved.device)
        moved = torch.cat([moved, pad]) if moved.shape[0] else pad
    return moved.contiguous(), dim, size, rest


def gather_to_owner(dt: torch.Tensor, owner: int,
                    dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    """The full tensor of DTensor ``dt`` on global rank ``owner`` (cast to ``dtype``)."""
    from torch.distributed.tensor import Shard

    mesh, placements = dt.device_mesh, dt.placements
    if mesh.ndim != 1 or not isinstance(placements[0], Shard):
        return _fallback(dt, owner, dtype)
    group = mesh.get_group()
    ranks = dist.get_process_group_ranks(group)
    if owner not in ranks:
        return _fallback(dt, owner, dtype)
    world, me = len(ranks), dist.get_rank()
    moved, dim, size, rest = _padded_shard(dt, world, ranks.index(me), dtype)
    if me != owner:
        dist.gather(moved, None, dst=owner, group=group)
        return None
    out = torch.empty((world * size,) + rest, dtype=moved.dtype, device=moved.device)
    dist.gather(moved, list(out.chunk(world)) if size else
                [out[:0] for _ in range(world)], dst=owner, group=group)
    full = out[: dt.shape[dim]]
    return full.movedim(0, dim) if dim else full


def coalescible(t: torch.Tensor) -> Optional[Any]:
    """The mesh group key if ``t`` can join a coalesced exchange (1-D mesh, one Shard)."""
    from torch.distributed.tensor import Shard

    if not is_dtensor(t) or t.device_mesh.ndim != 1 or not isinstance(t.placements[0], Shard) \
            or t.dim() == 0:
        return None
    return t.device_mesh.get_group()


def gather_many_to_owners(dts: list, owners: list[int], dtypes: list,
                          group: dist.ProcessGroup) -> list[Optional[torch.Tensor]]:
    """Full tensors of several DTensors sharded over ``group``, each on its owner, in one
    ``all_to_all``: every rank sends each owner the (padded) shards of the tensors it owns.
    Returns the full tensor where this rank is the owner, else None."""
    ranks = dist.get_process_group_ranks(group)
    world, me = len(ranks), dist.get_rank()
    index = ranks.index(me)
    by_dest: list[list[torch.Tensor]] = [[] for _ in ranks]
    metas = []
    for dt, owner, dtype in zip(dts, owners, dtypes):
        moved, dim, size, rest = _padded_shard(dt, world, index, dtype)
        flat = moved.reshape(-1).view(torch.uint8)
        by_dest[ranks.index(owner)].append(flat)
        metas.append((owner, flat.numel(), dim, size, rest, dt.shape[dim],
                      dtype if dtype is not None else dt.dtype))
    in_splits = [sum(f.numel() for f in parts) for parts in by_dest]
    flat_parts = [f for parts in by_dest for f in parts]
    device = dts[0].to_local().device
    send = torch.cat(flat_parts) if flat_parts else torch.empty(0, dtype=torch.uint8,
                                                                 device=device)
    per_source = sum(m[1] for m in metas if m[0] == me)   # equal from every rank (padded)
    out = torch.empty(per_source * world, dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, send, output_split_sizes=[per_source] * world,
                           input_split_sizes=in_splits, group=group)
    results: list[Optional[torch.Tensor]] = [None] * len(dts)
    offset = 0
    for i, (owner, nbytes, dim, size, rest, n, dtype) in enumerate(metas):
        if owner != me:
            continue
        pieces = [out[s * per_source + offset: s * per_source + offset + nbytes]
                  for s in range(world)]
        offset += nbytes
        full = torch.cat(pieces).view(dtype).view((world * size,) + rest)[:n]
        results[i] = full.movedim(0, dim) if dim else full
    return results
