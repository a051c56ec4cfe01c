"""Materialize FSDP2 (DTensor) parameters one at a time on one owning rank.

``DTensor.full_tensor()`` all-gathers: every rank ends up holding every full tensor. For
export only one rank needs each tensor, so :func:`gather_to_owner` does a ``gather`` to
the owner instead: each rank sends its (padded) shard, only the owner allocates the full
tensor, and the others get ``None``. Every rank must call it for the same tensors in the
same order (it is a collective on the DTensor's mesh group). Layouts other than a 1-D
mesh with one ``Shard`` placement fall back to ``full_tensor()`` on every rank.
:func:`gather_many_to_owners` moves many such tensors in one ``all_to_all``; both send
the same padded shards, the latter written straight into its send buffer (each shard cast,
laid out and padded in one copy). An owner whose only tensor of an exchange is that
tensor (a big one has an exchange to itself) receives it whole, in place: no
concatenation.

Called by :mod:`weightsync.trainer.export` only.
"""

from __future__ import annotations

import math
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


_ALIGN = 16  # bytes: where each tensor's region of an all_to_all buffer starts


def _chunk_sizes(n: int, world: int) -> tuple[int, list[int]]:
    """``torch.chunk`` semantics, which DTensor's ``Shard`` follows."""
    size = -(-n // world) if n else 0
    return size, [max(0, min(size, n - r * size)) for r in range(world)]


def _fallback(dt: torch.Tensor, owner: int, dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    full = dt.full_tensor()
    if dist.get_rank() != owner:
        return None
    return full if dtype is None or full.dtype == dtype else full.to(dtype)


def _shard_of(dt: torch.Tensor, world: int, index: int) -> tuple[torch.Tensor, int, int, tuple]:
    """This rank's (the ``index``-th of ``world``) shard of ``dt`` with the sharded dim moved
    first (a view): ``(shard, dim, chunk size every rank sends, shape of the other dims)``."""
    dim = dt.placements[0].dim % max(dt.dim(), 1)
    size, sizes = _chunk_sizes(dt.shape[dim], world)
    local = dt.to_local()
    moved = local.movedim(dim, 0) if dim else local
    if moved.shape[0] != sizes[index]:
        raise RuntimeError(f"unexpected shard of {tuple(dt.shape)} on rank {dist.get_rank()}: "
                           f"{tuple(local.shape)} (expected {sizes[index]} along dim {dim})")
    return moved, dim, size, tuple(moved.shape[1:])


def _write_padded(dst: torch.Tensor, shard: torch.Tensor) -> None:
    """``shard`` into the first rows of ``dst`` (cast and laid out in that one copy), the
    rest of ``dst`` zeroed."""
    n = shard.shape[0]
    if n:
        dst[:n].copy_(shard)
    if n < dst.shape[0]:
        dst[n:].zero_()


def _padded_shard(dt: torch.Tensor, world: int, index: int,
                  dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, int, int, tuple]:
    """:func:`_shard_of`, cast to ``dtype``, contiguous and zero-padded to the chunk size:
    ``(padded shard, dim, chunk size, shape of the other dims)``; no copy when the shard
    already is all that."""
    moved, dim, size, rest = _shard_of(dt, world, index)
    want = dtype if dtype is not None else moved.dtype
    if moved.shape[0] == size and moved.dtype == want and moved.is_contiguous():
        return moved, dim, size, rest
    out = torch.empty((size,) + rest, dtype=want, device=moved.device)
    _write_padded(out, moved)
    return out, dim, size, rest


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
    # the send buffer is written in place, grouped by destination rank: each shard cast,
    # moved and padded in one copy (no per-shard tensor, no concatenation); every region
    # starts at a multiple of _ALIGN bytes, so each one can be viewed in its own dtype
    shards, metas = [], []
    in_splits = [0] * world
    for dt, owner, dtype in zip(dts, owners, dtypes):
        moved, dim, size, rest = _shard_of(dt, world, index)
        want = dtype if dtype is not None else moved.dtype
        nbytes = size * math.prod(rest) * want.itemsize
        region = -(-nbytes // _ALIGN) * _ALIGN
        dest = ranks.index(owner)
        shards.append((dest, moved, want, (size,) + rest, nbytes, region))
        in_splits[dest] += region
        metas.append((owner, region, dim, size, rest, dt.shape[dim], want, nbytes))
    device = dts[0].to_local().device
    send = torch.empty(sum(in_splits), dtype=torch.uint8, device=device)
    cursor = [sum(in_splits[:d]) for d in range(world)]
    for dest, moved, want, shape, nbytes, region in shards:
        at = cursor[dest]
        cursor[dest] += region
        if nbytes:
            _write_padded(send[at: at + nbytes].view(want).view(shape), moved)
    per_source = sum(m[1] for m in metas if m[0] == me)   # equal from every rank (padded)
    out = torch.empty(per_source * world, dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, send, output_split_sizes=[per_source] * world,
                           input_split_sizes=in_splits, group=group)
    results: list[Optional[torch.Tensor]] = [None] * len(dts)
    offset = 0
    alone = sum(m[0] == me for m in metas) == 1
    for i, (owner, region, dim, size, rest, n, dtype, nbytes) in enumerate(metas):
        if owner != me:
            continue
        if alone and region == nbytes:
            # this rank's only tensor of the exchange: the sources' shards arrived end to
            # end, in rank order (each exactly its region), so they are the full tensor
            flat = out[: world * nbytes]
        else:
            flat = torch.cat([out[s * per_source + offset: s * per_source + offset + nbytes]
                              for s in range(world)])
        offset += region
        full = flat.view(dtype).view((world * size,) + rest)[:n]
        results[i] = full.movedim(0, dim) if dim else full
    return results
