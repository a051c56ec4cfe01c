"""Trainer export: plain, PEFT LoRA (merged, base, adapter), FSDP2 across 2 processes."""

from __future__ import annotations

import copy
import datetime
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from weightsync.rollout.hf import build_causal_lm, lora_config_from_dict  # noqa: E402
from weightsync.testing.toymodel import lora_config, tiny_qwen2_config  # noqa: E402
from weightsync.trainer import export_weights, lora_config_dict, plan_export  # noqa: E402

pytestmark = pytest.mark.timeout(240)
CFG = tiny_qwen2_config(vocab_size=1001, hidden_size=64, intermediate_size=128)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def _peft_model(seed=0):
    model = build_causal_lm(CFG, seed=seed)
    torch.manual_seed(seed + 1)
    return peft.get_peft_model(model, peft.LoraConfig(**lora_config(random_init=True)))


def test_plain_model_exports_state_dict_names_and_bytes():
    model = build_causal_lm(CFG, seed=0)
    out = dict(export_weights(model))
    assert list(out) == list(model.state_dict())
    assert _equal_states(out, model.state_dict())
    cast = dict(export_weights(model, dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in cast.values())
    assert torch.equal(cast["lm_head.weight"], model.lm_head.weight.detach().to(torch.bfloat16))
    with pytest.raises(ValueError, match="PEFT"):
        list(export_weights(model, kind="adapter"))
    with pytest.raises(ValueError, match="kind"):
        list(export_weights(model, kind="weird"))


def test_lora_merged_equals_peft_merge_and_leaves_model_unchanged():
    model = _peft_model()
    before = _state(model)
    merged = dict(export_weights(model, kind="full"))
    assert _equal_states(before, _state(model)), "export changed the trainer model"
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == expected.keys()
    for name in expected:
        assert torch.equal(_bits(merged[name]), _bits(expected[name])), name
    # and it really differs from the base for the LoRA targets
    base = dict(export_weights(model, kind="base"))
    assert base.keys() == merged.keys()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(base[q], merged[q])
    assert torch.equal(base[q], model.get_base_model().model.layers[0].self_attn.q_proj
                       .base_layer.weight)


def test_lora_adapter_export_matches_peft_state_dict_and_config_roundtrips():
    model = _peft_model()
    adapter = dict(export_weights(model, kind="adapter"))
    expected = peft.get_peft_model_state_dict(model)
    assert adapter.keys() == expected.keys() and len(adapter) == 2 * 4 * 2
    assert all(torch.equal(adapter[k], expected[k]) for k in adapter)
    cfg = lora_config_dict(model)
    rebuilt = lora_config_from_dict(json.loads(json.dumps(cfg)))
    assert sorted(rebuilt.target_modules) == sorted(model.peft_config["default"].target_modules)
    assert rebuilt.r == 8 and rebuilt.lora_alpha == 16


def _fsdp_case(rank: int, world: int, lora: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _peft_model() if lora else build_causal_lm(CFG, seed=0)
    reference = dict(export_weights(copy.deepcopy(model), kind="full", owner=rank))
    mesh = init_device_mesh("cpu", (world,))
    layers = model.get_base_model().model.layers if lora else model.model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    mine = dict(export_weights(model, kind="full"))
    one_by_one = dict(export_weights(model, kind="full", coalesce_bytes=1))
    on_zero = dict(export_weights(model, kind="full", owner=0))
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    shards = list(export_weights(model, kind="full", shards=True))
    shard_full = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in shards}
    return {
        "shard_names": [n for n, _ in shards],
        "shard_dtensors": sum(type(t).__name__ == "DTensor" for _, t in shards),
        "shard_local_bytes": sum((t.to_local() if hasattr(t, "to_local") else t).numel()
                                 * t.element_size() for _, t in shards),
        "shard_equal": all(torch.equal(_bits(t), _bits(reference[k]))
                           for k, t in shard_full.items()),
        "names": sorted(mine),
        "bytes": sum(t.numel() * t.element_size() for t in mine.values()),
        "equal_full": lora or all(torch.equal(t, full[k]) for k, t in mine.items()),
        "equal_reference": all(torch.equal(_bits(t), _bits(reference[k]))
                               for k, t in mine.items()),
        "one_by_one_equal": sorted(one_by_one) == sorted(mine) and all(
            torch.equal(_bits(t), _bits(mine[k])) for k, t in one_by_one.items()),
        "owner0": sorted(on_zero),
        "owner0_equal": all(torch.equal(_bits(t), _bits(reference[k]))
                            for k, t in on_zero.items()),
        "all": sorted(reference),
    }


def _fsdp_worker(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    result = {lora: _fsdp_case(rank, world, lora) for lora in (False, True)}
    with open(os.path.join(path, f"r{rank}.json"), "w") as f:
        json.dump({str(k): v for k, v in result.items()}, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    import socket

    import torch.multiprocessing as mp

    path = tmp_path_factory.mktemp("fsdp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_fsdp_worker, args=(2, port, str(path)), nprocs=2,
                       start_method="spawn", join=True)
    out = []
    for i in range(2):
        with open(path / f"r{i}.json") as f:
            out.append({k == "True": v for k, v in json.load(f).items()})
    return out


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora-merged"])
def test_fsdp2_export_spreads_ownership_and_matches_unsharded(fsdp_results, lora):
    r0, r1 = (r[lora] for r in fsdp_results)
    assert not set(r0["names"]) & set(r1["names"]), "a tensor was exported by both ranks"
    assert sorted(r0["names"] + r1["names"]) == r0["all"]
    assert r0["equal_reference"] and r1["equal_reference"]
    assert r0["equal_full"] and r1["equal_full"]
    assert r0["one_by_one_equal"] and r1["one_by_one_equal"]
    total = r0["bytes"] + r1["bytes"]
    assert max(r0["bytes"], r1["bytes"]) < 0.6 * total, "ownership is not spread"
    assert r0["owner0"] == r0["all"] and r1["owner0"] == [] and r0["owner0_equal"]
    # shards=True (for backends that serve shards): every rank yields every name, FSDP2
    # parameters as their DTensor shards, no gather: each rank holds about half the bytes
    for r in (r0, r1):
        assert sorted(r["shard_names"]) == r0["all"] and r["shard_equal"]
    if not lora:
        assert r0["shard_dtensors"] > 0
        assert max(r0["shard_local_bytes"], r1["shard_local_bytes"]) < 0.6 * total


def test_plan_export_kinds_for_peft():
    model = _peft_model()
    kinds = {k: [i.name for i in plan_export(model, k)] for k in ("full", "base", "adapter")}
    assert kinds["full"] == kinds["base"]
    assert all(".lora_" not in n and "base_layer" not in n for n in kinds["full"])
    assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in kinds["adapter"])


def _many_worker(rank: int, world: int, port: int, path: str) -> None:
    """gather_many_to_owners over DTensors of mixed dtypes, odd sizes (padded shards,
    regions of odd byte counts), shards on dim 0 and dim 1, some cast on the way."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from weightsync.trainer import fsdp

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    cases = [((7, 3), torch.float16, 0, None), ((5,), torch.int8, 0, None),
             ((9, 5), torch.float32, 0, torch.bfloat16), ((3, 11), torch.bfloat16, 1, None),
             ((1, 4), torch.float32, 0, None), ((13,), torch.bool, 0, None),
             ((6, 7), torch.float64, 1, torch.float16), ((4, 2), torch.int64, 0, None)]

    def sharded(cases):
        """(expected full tensors, their DTensors, export casts) of (shape, dtype, dim, cast)"""
        fulls, dts, dtypes = [], [], []
        for shape, dtype, dim, cast in cases:
            full = (torch.randn(shape, generator=g) * 50).to(dtype)
            fulls.append(full if cast is None else full.to(cast))
            dts.append(distribute_tensor(full, mesh, [Shard(dim)]))
            dtypes.append(cast)
        return fulls, dts, dtypes

    fulls, dts, dtypes = sharded(cases)
    owners = [i % world for i in range(len(cases))]
    cats = [0]
    real_cat = torch.cat

    def counted(*args, **kwargs):
        cats[0] += 1
        return real_cat(*args, **kwargs)

    torch.cat = counted
    try:
        got = fsdp.gather_many_to_owners(dts, owners, dtypes, mesh.get_group())
    finally:
        torch.cat = real_cat
    mine = [i for i, o in enumerate(owners) if o == rank]
    result = {"none_elsewhere": all(got[i] is None for i, o in enumerate(owners) if o != rank),
              "equal": all(got[i] is not None and got[i].dtype == fulls[i].dtype
                           and torch.equal(got[i], fulls[i]) for i in mine),
              "cats": cats[0], "owned": len(mine)}
    # one tensor per owner in an exchange (as a big tensor has one to itself): whole
    # shards of 16-byte multiples arrive end to end and need no concatenation; odd-sized
    # ones (padded regions) still do
    alone = [((10, 8), torch.float32, 0, torch.bfloat16), ((6, 16), torch.float32, 1, None),
             ((5,), torch.int8, 0, None), ((9, 4), torch.float32, 0, None)]
    for k, pair in enumerate((alone[:2], alone[2:])):
        fulls, dts, dtypes = sharded(pair)
        cats[0] = 0
        torch.cat = counted
        try:
            got = fsdp.gather_many_to_owners(dts, [0, 1], dtypes, mesh.get_group())
        finally:
            torch.cat = real_cat
        result[f"alone{k}_equal"] = got[rank] is not None and \
            got[rank].dtype == fulls[rank].dtype and torch.equal(got[rank], fulls[rank])
        result[f"alone{k}_cats"] = cats[0]
    with open(os.path.join(path, f"m{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def test_fsdp2_exchange_writes_shards_straight_into_the_send_buffer(tmp_path):
    """Every owner gets its tensors bit-exact (cast where asked) and the send side makes no
    concatenation: the only ``torch.cat`` left is the owner's, one per tensor it owns when
    it owns several in one exchange, none when it owns one of whole shards."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_many_worker, args=(2, port, str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    for rank in range(2):
        r = json.loads((tmp_path / f"m{rank}.json").read_text())
        assert r["none_elsewhere"] and r["equal"], r
        assert r["cats"] == r["owned"], r
        assert r["alone0_equal"] and r["alone0_cats"] == 0, r
        # rank 0's int8 shard (3 bytes in a 16-byte region) is concatenated; rank 1's
        # float32 shard (5 rows x 4 x 4 = 80 bytes) is not
        assert r["alone1_equal"] and r["alone1_cats"] == (1 if rank == 0 else 0), r
