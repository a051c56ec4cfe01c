"""Tests of ``weightsync plan`` (weightsync.tools.planner): bad input, the JSON document,
a small model end to end, hand-computed link arithmetic, and that the numbers come from
compile_plan / build_plan (the code the backends run)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from weightsync.core.plan import itemsize
from weightsync.core.xferplan import (DestLayout, HeldBox, SourceLayout, TransferPlan, Want,
                                      compile_plan)
from weightsync.tools.cli import main
from weightsync.tools.planner import (PlannerError, Scenario, load_links, load_model,
                                      model_from_tensors, plan, predict)
from weightsync.tools.planner import compiled as compiled_mod
from weightsync.tools.planner import bucketed as bucketed_mod
from weightsync.tools.planner.compiled import pull_stats, rank_boxes, staged_boxes
from weightsync.tools.planner.rules import planned_tensors

pytestmark = pytest.mark.timeout(60)

TINY_MOE = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512,
            "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "num_experts": 4,
            "num_experts_per_tok": 2, "vocab_size": 1000, "tie_word_embeddings": False}


def tiny_links(**links) -> dict:
    doc = {"name": "tiny", "device": "gpu", "gpus_per_node": 2,
           "links": {"nic": {"GBps": 1.0}, "intra": {"GBps": 4.0},
                     "device_mem": {"GBps": 1e6}},
           "software": {"tensor_us": 0, "bucket_us": 0, "read_us": 0, "control_us": 0,
                        "op_us": 0}}
    doc["links"].update(links)
    return doc


@pytest.fixture
def moe_dir(tmp_path):
    d = tmp_path / "tiny-moe"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_MOE))
    return str(d)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("argv, field, words", [
    (["--model", "NoSuchModelConfig"], "model", "unknown architecture"),
    (["--tp", "3"], "rollout.tp", "not divisible by 3"),
    (["--tp", "2", "--ep", "3"], "rollout.ep", "not divisible by 6"),
    (["--replicas", "0"], "rollout.replicas", ">= 1"),
    (["--strategies", "p2p,teleport"], "strategies", "teleport"),
    (["--links", "no-such-preset"], "links", "neither a preset"),
    (["--links", "cpu-2core", "--trainer-gpus", "70"], "links.gpus_per_node", "at most 64"),
    ([], "model", "missing"),
    (["--model", "bench:nope"], "model", "bench workload 'nope'"),
    (["--link-set", "nosuch.x=1"], "link-set.nosuch.x", "no such section"),
])
def test_bad_input_names_the_field(capsys, moe_dir, argv, field, words):
    base = [] if "--model" in argv or not argv else ["--model", moe_dir]
    if argv and argv[0] == "--link-set":
        base = ["--model", "bench:synthetic-16MiB"]
    rc, out, err = run_cli(capsys, *base, *argv)
    assert rc == 2
    assert f"weightsync plan: error: {field}:" in err and words in err
    assert "Traceback" not in err + out


def test_unknown_model_type_in_a_json_file(capsys, tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"model_type": "frobnicator", "hidden_size": 8}))
    rc, _, err = run_cli(capsys, "--model", str(path))
    assert rc == 2 and "model.model_type: unknown architecture 'frobnicator'" in err


@pytest.mark.parametrize("mutate, field, words", [
    (lambda d: d["links"]["nic"].pop("GBps"), "links.nic.GBps", "missing"),
    (lambda d: d["links"]["intra"].update(latency_us=-1), "links.intra.latency_us", ">= 0"),
    (lambda d: d["links"]["nic"].update(GBps=0), "links.nic.GBps", "> 0"),
    (lambda d: d["links"]["nic"].update(efficiency=1.5), "links.nic.efficiency", "<= 1.0"),
    (lambda d: d["links"].pop("device_mem"), "links.device_mem", "missing"),
    (lambda d: d["software"].pop("read_us"), "links.software.read_us", "missing"),
    (lambda d: d.update(gpus_per_node="eight"), "links.gpus_per_node", "a number"),
])
def test_bad_links_file(capsys, tmp_path, moe_dir, mutate, field, words):
    doc = tiny_links()
    mutate(doc)
    path = tmp_path / "links.json"
    path.write_text(json.dumps(doc))
    rc, out, err = run_cli(capsys, "--model", moe_dir, "--links", str(path))
    assert rc == 2 and f"error: {field}:" in err and words in err
    assert "Traceback" not in err + out


def test_yaml_links_file(capsys, tmp_path, moe_dir):
    yaml = pytest.importorskip("yaml")
    doc = tiny_links()
    doc["links"]["nic"]["GBps"] = -3
    path = tmp_path / "links.yaml"
    path.write_text(yaml.safe_dump(doc))
    rc, _, err = run_cli(capsys, "--model", moe_dir, "--links", str(path))
    assert rc == 2 and "links.nic.GBps: must be > 0, got -3" in err


def test_exit_code_of_the_installed_command(tmp_path):
    """The real entry point: exit status 2, one error line, no traceback."""
    bad = tmp_path / "links.json"
    bad.write_text(json.dumps({"device": "gpu", "gpus_per_node": -8}))
    proc = subprocess.run([sys.executable, "-m", "weightsync.tools.cli", "plan", "--model",
                           "kimi-k2", "--links", str(bad)], capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("weightsync plan: error: links.gpus_per_node: must be > 0, "
                                   "got -8")


# ------------------------------------------------------------------ end to end

def test_small_model_end_to_end_json_and_plot(capsys, tmp_path, moe_dir):
    js, png = tmp_path / "p.json", tmp_path / "p.png"
    rc, out, _ = run_cli(capsys, "--model", moe_dir, "--trainer-gpus", "4", "--replicas", "2",
                         "--tp", "2", "--links", "h100-8gpu-400g", "--placement", "packed",
                         "--json", str(js), "--plot", str(png))
    assert rc == 0 and "line-rate bound" in out and "p2p" in out
    doc = json.loads(js.read_text())
    assert doc["schema"] == "weightsync.plan/1"
    assert set(doc) >= {"scenario", "bound", "plan", "strategies", "notes", "command"}
    assert doc["scenario"]["rollout"] == {"replicas": 2, "tp": 2, "ep": 0, "workers": 4,
                                          "placement": "packed"}
    assert set(doc["strategies"]) == {"p2p", "broadcast", "ring"}
    for name, s in doc["strategies"].items():
        assert s["applicable"], name
        assert s["seconds"] > 0 and s["ratio_to_bound"] >= 1.0 - 1e-9
        assert {"phase", "limited_by", "seconds"} <= set(s["bottleneck"])
        assert len(s["bytes_per_source"]["values"]) == 4
        assert len(s["bytes_per_dest"]["values"]) == 4
        assert s["reads_per_dest"]["max"] >= 1 and s["links"]
    assert doc["plan"]["compile_plan_calls"] == len(doc["plan"]["classes"]) > 0
    assert doc["bound"]["seconds"] > 0 and doc["bound"]["via"] == ["intra"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ring_needs_one_node(moe_dir):
    p = plan(moe_dir, links="h100-8gpu-400g", trainer_gpus=8, replicas=1, tp=2)
    assert not p.results["ring"].applicable and "one node" in p.results["ring"].reason
    assert p.to_dict()["strategies"]["ring"] == {"applicable": False,
                                                 "reason": p.results["ring"].reason}


# ------------------------------------------------------------------ hand-computed arithmetic

def _one_tensor(name: str, shape=(1024, 1024)):
    return model_from_tensors("one", [(name, shape)])


def test_bound_and_bottleneck_tiny_case():
    """Two FSDP2 ranks on node 0, one TP-2 replica on node 1, 1 GB/s NICs: each worker keeps
    half of a 2 MiB bf16 matrix, column-split: 1 MiB, all of it from one rank."""
    sc = Scenario(model=_one_tensor("x.q_proj.weight"), links=load_links(tiny_links()),
                  trainer_gpus=2, replicas=1, tp=2, strategies=("p2p",), pipelined=False,
                  serve="staging")
    p = predict(sc)
    mib = 1 << 20
    assert p.bound["bytes"] == mib and p.bound["via"] == ["nic"]
    assert p.bound["seconds"] == pytest.approx(mib / 1e9, rel=1e-12)
    r = p.results["p2p"]
    pull = next(ph for ph in r.phases if ph.name == "pull")
    assert pull.seconds == pytest.approx(mib / 1e9, rel=1e-12)
    assert pull.limit.startswith("nic_in n1.g0") or pull.limit.startswith("nic_out n0.g0")
    assert r.dest_bytes == [mib, mib] and r.source_bytes == [mib, mib]
    assert r.dest_reads == [1, 1]                  # one contiguous block each
    serve = r.phases[0].seconds                    # 1 MiB copied per rank at 1e6 GB/s
    assert serve == pytest.approx(mib / 1e15, rel=1e-9)
    assert p.ratio("p2p") == pytest.approx(sum(ph.seconds for ph in r.phases) / (mib / 1e9))


def test_contention_on_a_shared_nic():
    """One trainer rank feeding two replicas through its one NIC: twice the bound."""
    sc = Scenario(model=_one_tensor("x.norm.weight", (1 << 20,)), links=load_links(tiny_links()),
                  trainer_gpus=1, replicas=2, tp=1, strategies=("p2p",), pipelined=False)
    p = predict(sc)
    two_mib = 2 << 20
    assert p.bound["seconds"] == pytest.approx(two_mib / 1e9)
    pull = p.results["p2p"].phases[1]
    assert pull.limit.startswith("nic_out n0.g0 (trainer rank 0)")
    assert pull.limit_seconds == pytest.approx(2 * two_mib / 1e9)
    assert p.ratio("p2p") == pytest.approx(2.0, rel=1e-3)


def test_row_parallel_reads_and_latency():
    """Row-parallel split: the trainers stage the workers' column halves box by box (as
    the nixl trainer does once the workers said what they keep), so each worker reads one
    piece per trainer rank; per-read software and latency are added, and the staging copy
    is counted even where the rank would serve the rest from its own storage."""
    links = tiny_links(nic={"GBps": 1.0, "latency_us": 7})
    links["software"].update(read_us=1, control_us=3)
    sc = Scenario(model=_one_tensor("x.o_proj.weight", (64, 128)), links=load_links(links),
                  trainer_gpus=2, replicas=1, tp=2, strategies=("p2p",), pipelined=False)
    r = predict(sc).results["p2p"]
    assert r.dest_reads == [2, 2]                  # its 32 rows x 64 columns from each rank
    pull = r.phases[1]
    wire = 2 * 32 * 64 * 2 / 1e9                   # 2 ranks x 32 rows x 64 cols x 2 B
    assert pull.limit_seconds == pytest.approx(max(wire, 2e-6))
    assert pull.latency == pytest.approx(10e-6)



def test_pipelined_staging_overlaps_the_pull_and_shares_its_resources():
    """The backend's pipelined warm sync: staging and the pull are one phase that lasts
    its busiest resource (loads of both added where they share one) plus the round trip
    and the writing of the first block; unpipelined, the two phases add up."""
    links = tiny_links(nic={"GBps": 1.0, "latency_us": 7},
                       device_mem={"GBps": 0.5})              # staging slower than the NIC
    model = _one_tensor("x.norm.weight", (4 << 20,))          # 8 MiB bf16, one rank
    kw = dict(model=model, links=load_links(links), trainer_gpus=1, replicas=1, tp=1,
              strategies=("p2p",), bucket_size=1 << 20, serve="staging")
    serial = predict(Scenario(**kw, pipelined=False)).results["p2p"]
    piped = predict(Scenario(**kw)).results["p2p"]
    serve, pull = serial.phases[0], serial.phases[1]
    both = piped.phases[0]
    assert both.name == "serve+pull (pipelined)"
    nbytes = 8 << 20
    assert serve.limit_seconds == pytest.approx(nbytes / 0.5e9)
    # the trainer's device memory carries the staging copy; the worker's the landing,
    # and the busiest resource of the joint phase is the staging one, not the NIC
    assert both.limit_seconds == pytest.approx(max(serve.limit_seconds, pull.limit_seconds))
    first_block = serve.limit_seconds * (1 << 20) / nbytes
    assert both.latency == pytest.approx(pull.latency + first_block)
    assert piped.seconds < serial.seconds
    assert piped.seconds == pytest.approx(both.seconds + piped.phases[1].seconds)
    # served from its own storage (the default, no cast), the trainer stages nothing
    own = predict(Scenario(**{**kw, "serve": "auto"})).results["p2p"]
    assert own.phases[0].limit_seconds == pytest.approx(pull.limit_seconds)


def test_staging_on_a_host_is_its_own_phase_even_pipelined():
    """On a host links file the staging copy was measured not to hide behind the pulls
    (p2p's module doc): pipelined or not, bytes staged on a host are a serve phase before
    the pull. Served from the tensors' own storage (nothing staged) the pull stays one
    pipelined phase."""
    model = _one_tensor("x.norm.weight", (64 << 20,))         # 128 MiB bf16, one rank
    kw = dict(model=model, links=load_links("cpu-2core"), trainer_gpus=1, replicas=1,
              tp=1, strategies=("p2p",), bucket_size=64 << 20, serve="staging")
    piped = predict(Scenario(**kw)).results["p2p"]
    serial = predict(Scenario(**kw, pipelined=False)).results["p2p"]
    assert [p.name for p in piped.phases] == ["serve", "pull", "apply"]
    assert piped.seconds == pytest.approx(serial.seconds, rel=1e-12)
    own = predict(Scenario(**{**kw, "serve": "auto"})).results["p2p"]
    assert own.phases[0].name == "serve+pull (pipelined)"
    assert own.seconds < piped.seconds


# ------------------------------------------------------------------ same code as the backends

def test_prediction_comes_from_compile_plan(monkeypatch, moe_dir):
    calls = []

    def spy(sources, dests, **kw):
        plan_ = compile_plan(sources, dests, **kw)
        calls.append(plan_)
        return plan_
    monkeypatch.setattr(compiled_mod, "compile_plan", spy)
    p = plan(moe_dir, links="h100-8gpu-400g", trainer_gpus=4, replicas=1, tp=2,
             strategies=("p2p",))
    assert len(calls) == p.stats.compile_calls > 0
    assert all(c.reads for c in calls)

    def halved(sources, dests, **kw):   # the real plan with every READ half as long
        real = compile_plan(sources, dests, **kw)
        reads = tuple(dataclasses.replace(r, nbytes=max(r.nbytes // 2, 1)) for r in real.reads)
        return TransferPlan(reads=reads, tensors=real.tensors, ranks=real.ranks,
                            workers=real.workers)
    monkeypatch.setattr(compiled_mod, "compile_plan", halved)
    q = plan(moe_dir, links="h100-8gpu-400g", trainer_gpus=4, replicas=1, tp=2,
             strategies=("p2p",))
    full, half = sum(p.results["p2p"].dest_bytes), sum(q.results["p2p"].dest_bytes)
    assert half < 0.6 * full


def test_bucketed_strategies_use_build_plan(monkeypatch, moe_dir):
    seen = []
    real = bucketed_mod.build_plan

    def spy(tensors, bucket_size, *a, **kw):
        out = real(tensors, bucket_size, *a, **kw)
        seen.append((len(out.buckets), bucket_size))
        return out
    monkeypatch.setattr(bucketed_mod, "build_plan", spy)
    p = plan(moe_dir, links="h100-8gpu-400g", trainer_gpus=1, replicas=1, tp=1,
             placement="packed", bucket_size=1 << 20, strategies=("broadcast",))
    assert seen and seen[0][1] == 1 << 20
    assert p.results["broadcast"].dest_reads == [seen[0][0]]


def _dest_layout(pts, g, name):
    """Worker ``g``'s wants of every tensor, each in a buffer of its own."""
    wants = []
    for pt in pts:
        off = 0
        for box in pt.boxes[g]:
            wants.append(Want(name=pt.name, dtype=pt.dst_dtype, box=box, dest=pt.name,
                              offset=off))
            off += math.prod(b - a for a, b in box) * itemsize(pt.dst_dtype)
    return DestLayout(worker=name, wants=tuple(wants))


def _whole_model_pairs(pts, world, workers):
    """One compile_plan of every tensor at once (own region / buffer per tensor)."""
    sources = []
    for r in range(world):
        held = []
        for pt in pts:       # FSDP2 rows, cut into the workers' boxes where the arena does
            off = 0
            for box in staged_boxes(pt, r, world):
                n = math.prod(b - a for a, b in box)
                if n:
                    held.append(HeldBox(name=pt.name, shape=pt.shape, dtype=pt.src_dtype,
                                        box=box, region=pt.name, offset=off))
                    off += n * itemsize(pt.src_dtype)
        sources.append(SourceLayout(rank=r, held=tuple(held)))
    dests = [_dest_layout(pts, g, f"g{g}") for g in range(workers)]
    whole = compile_plan(sources, dests)
    nb, nr = np.zeros((world, workers)), np.zeros((world, workers))
    for rd in whole.reads:
        nb[rd.src_rank, int(rd.dst_worker[1:])] += rd.nbytes
        nr[rd.src_rank, int(rd.dst_worker[1:])] += 1
    return nb, nr


@pytest.mark.parametrize("tp, ep, dst", [(2, 0, "bfloat16"), (2, 2, "fp8"), (4, 0, "fp8")])
def test_aggregation_equals_one_whole_compile(moe_dir, tp, ep, dst):
    """Per-layout compiles x counts, shared workers and collapsed dims == one compile."""
    model = load_model(moe_dir)
    pts, _ = planned_tensors(model, tp, ep, "bfloat16", dst)
    workers = tp * max(ep, 1)
    stats = pull_stats(pts, 3, workers)
    nb, nr = _whole_model_pairs(pts, 3, workers)
    assert np.array_equal(stats.pair_bytes, nb)
    assert np.array_equal(stats.pair_reads, nr)
    assert stats.compile_calls < len(pts)
    if ep == 0:
        assert any(c.factor > 1 for c in stats.classes)   # experts' down_proj [E, H, I]


def _whole_model_boxes(pts, world, workers, shard, replicas=1):
    """The backend's compile for trainer boxes: every tensor held as the ranks' boxes
    (HeldBox, own region per tensor); each worker of
    every replica compiled alone with its index as ``spread``, as each nixl receiver."""
    sources = []
    for r in range(world):
        held = []
        for pt in pts:
            off = 0
            for box in staged_boxes(pt, r, world, shard):   # cut where the arena cuts
                held.append(HeldBox(name=pt.name, shape=pt.shape, dtype=pt.src_dtype, box=box,
                                    region=pt.name, offset=off))
                off += math.prod(b - a for a, b in box) * itemsize(pt.src_dtype)
        if held:
            sources.append(SourceLayout(rank=r, held=tuple(held)))
    # each nixl receiver compiles its own plan; its rank turns ties among holders
    plans = [compile_plan(sources, [_dest_layout(pts, i % workers, f"g{i}")], spread=i)
             for i in range(workers * replicas)]
    cols = workers * replicas
    nb, nr = np.zeros((world, cols)), np.zeros((world, cols))
    for plan_ in plans:
        for rd in plan_.reads:
            nb[rd.src_rank, int(rd.dst_worker[1:])] += rd.nbytes
            nr[rd.src_rank, int(rd.dst_worker[1:])] += 1
    return nb, nr


@pytest.mark.parametrize("ttp, tep, shard, world, tp, ep", [
    (2, 0, "fsdp", 4, 4, 0), (2, 2, "fsdp", 8, 2, 2), (2, 2, "full", 8, 2, 0),
    (4, 0, "full", 8, 2, 2), (2, 0, "fsdp", 2, 1, 0)])
def test_trainer_tp_ep_aggregation_equals_the_backends_compile(moe_dir, ttp, tep, shard,
                                                                world, tp, ep):
    """A TP/EP trainer (its shards' rows chunked by FSDP2 or replicated over DP): the
    per-layout compiles, grouped workers and collapsed dims equal the compile the nixl
    backend runs (HeldBox sources, one compile per receiver with replicated holders)."""
    model = load_model(moe_dir)
    pts, _ = planned_tensors(model, tp, ep, "bfloat16", "bfloat16", "trainer", ttp, tep)
    workers, replicas = tp * max(ep, 1), 2
    stats = pull_stats(pts, world, workers, None, shard, replicas)
    nb, nr = _whole_model_boxes(pts, world, workers, shard, replicas)
    # what each worker takes in is exact; which of several holders serves it is the
    # receiver's greedy over its whole plan, here per tensor layout (carrying the loads):
    # an approximation, held to the errors measured on these cases (compiled.py's doc)
    assert np.array_equal(stats.pair_bytes.sum(0), nb.sum(0))
    assert np.allclose(stats.pair_bytes.sum(1), nb.sum(1), rtol=0.25, atol=0.02 * nb.sum() / world)
    assert np.allclose(stats.pair_reads.sum(0), nr.sum(0), rtol=0.55)
    # FSDP2 splits each group rank's boxes over the DP ranks; "full" copies them to each
    held = sum(math.prod(b - a for a, b in box) for pt in pts for r in range(world)
               for box in rank_boxes(pt, r, world, shard))
    group = ttp * max(tep, 1)
    boxes = sum(math.prod(b - a for a, b in box) for pt in pts for g in range(group)
                for box in (pt.held[g] if pt.held else (tuple((0, n) for n in pt.shape),)))
    assert held == boxes * (1 if shard == "fsdp" else world // group)


def test_trainer_layout_that_does_not_divide_is_named(moe_dir, capsys):
    model = load_model(moe_dir)
    with pytest.raises(PlannerError, match="trainer.tp"):
        Scenario(model=model, links=load_links("h100-8gpu-400g"), trainer_gpus=6,
                 replicas=1, trainer_tp=4)
    with pytest.raises(PlannerError, match="trainer.tp"):     # a dim 3 does not divide
        planned_tensors(model, 1, 0, "bfloat16", "bfloat16", "trainer", 3, 0)
    assert main(["plan", "--model", moe_dir, "--trainer-gpus", "6", "--trainer-tp", "4"]) == 2
    err = capsys.readouterr().err
    assert "trainer.tp" in err and "Traceback" not in err


# ------------------------------------------------------------------ slicing rules

def test_slicing_rules(moe_dir):
    model = load_model(moe_dir)
    pts = {pt.name: pt for pt in planned_tensors(model, 4, 0, "bfloat16", "bfloat16")[0]}
    k = pts["model.layers.0.self_attn.k_proj.weight"]        # 2 kv heads of 64, tp 4
    assert [b[0][0] for b in k.boxes] == [(0, 64), (0, 64), (64, 128), (64, 128)]
    o = pts["model.layers.0.self_attn.o_proj.weight"]
    assert o.boxes[1] == (((0, 256), (64, 128)),)
    emb = pts["model.embed_tokens.weight"]                   # 1000 rows padded to 1024
    assert emb.boxes[3] == (((768, 1000), (0, 256)),)
    gu = pts["model.layers.0.mlp.experts.gate_up_proj"]      # [4, 256, 256]: gate|up halves
    assert gu.boxes[1] == (((0, 4), (32, 64), (0, 256)), ((0, 4), (160, 192), (0, 256)))
    norm = pts["model.layers.0.input_layernorm.weight"]
    assert all(b == (((0, 256),),) for b in norm.boxes)
    with pytest.raises(PlannerError, match="rollout.ep"):
        planned_tensors(model, 4, 2, "bfloat16", "bfloat16")


def test_fp8_blocks_and_scales(moe_dir):
    model = load_model(moe_dir)
    pts, notes = planned_tensors(model, 4, 0, "bfloat16", "fp8")
    by = {pt.name: pt for pt in pts}
    q = by["model.layers.0.self_attn.q_proj.weight"]
    assert (q.src_dtype, q.dst_dtype) == ("float8_e4m3fn", "float8_e4m3fn")
    s = by["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert s.shape == (2, 2) and s.src_dtype == "float32"
    assert by["model.embed_tokens.weight"].dst_dtype == "bfloat16"
    assert by["model.layers.0.mlp.gate.weight"].dst_dtype == "bfloat16"   # router
    assert any("not a multiple of the 128-block" in n for n in notes)  # 64-row q slices
    recv = {pt.name: pt for pt in planned_tensors(model, 4, 0, "bfloat16", "fp8", "receiver")[0]}
    assert recv["model.layers.0.self_attn.q_proj.weight"].src_dtype == "bfloat16"
    assert not any(n.endswith("_scale_inv") for n in recv)


# ------------------------------------------------------------------ the big case

def test_kimi_k2_plans_fast_and_near_the_bound():
    """Kimi-K2 (1.03 T params), 256 H100 -> 8 x (TP 8 x EP 2), FP8: p2p only, meta device."""
    import resource
    import time
    t0 = time.perf_counter()
    p = plan("kimi-k2", links="h100-8gpu-400g", trainer_gpus=256, replicas=8, tp=8, ep=2,
             dst_dtype="fp8", strategies=("p2p",))
    assert time.perf_counter() - t0 < 30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 4 << 20   # KiB: 4 GiB
    assert 1.25 < p.bound["seconds"] < 1.4                     # ~66 GB at 50 GB/s
    pull = next(ph for ph in p.results["p2p"].phases if ph.name.startswith("serve+pull"))
    assert pull.seconds / p.bound["seconds"] < 1.01 and "nic_in" in pull.limit
    assert p.ratio("p2p") <= 1.1                  # the whole sync, apply included
    assert p.stats.compile_calls < 40


def test_every_preset_file_is_package_data():
    """The presets travel in the wheel: pyproject's package-data globs cover every file
    under planner/presets (a non-editable install would miss one otherwise)."""
    import fnmatch
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    conf = tomllib.loads((root / "pyproject.toml").read_text())
    globs = conf["tool"]["setuptools"]["package-data"]["weightsync.tools.planner"]
    pkg = root / "src" / "weightsync" / "tools" / "planner"
    files = [p.relative_to(pkg).as_posix() for p in (pkg / "presets").rglob("*") if p.is_file()]
    assert files
    missing = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert not missing, missing


def test_a_hosts_cores_price_copies_and_a_cpu_bound_broadcast():
    """On a host links file with ``cores``, a gloo broadcast costs every core for as long as
    the raw broadcast of its bytes took, and each copy costs one core its bytes at the
    copy rate: on 2 cores a 1 -> 1 collective is bytes / gloo + (pack + unpack) / 2, not the
    wire alone; more cores give that back; cores on a GPU links file are refused."""
    # 4 MiB tensors: below the collective's direct size, so each is packed and unpacked
    model = model_from_tensors("small", [(f"l{i}.w", (1024, 2048)) for i in range(128)])

    def secs(**sets):
        # no software costs: they take the cores too (the next test), not this one's subject
        links = load_links("cpu-2core", {**{"links.device_mem.GBps": 10.0,
                                            "collective.GBps": 4.0, "software.tensor_us": 0,
                                            "software.bucket_us": 0, "software.op_us": 0},
                                         **sets})
        p = predict(Scenario(model=model, links=links, trainer_gpus=1, replicas=1,
                             strategies=("broadcast",)))
        return p.results["broadcast"]
    two = secs()
    nbytes = 128 * 1024 * 2048 * 2
    assert "cores" in two.bottleneck.limit
    assert two.bottleneck.limit_seconds == pytest.approx(nbytes / 4e9 + nbytes / 10e9, rel=0.02)
    many = secs(cores=64)
    assert "cores" not in many.bottleneck.limit
    assert many.bottleneck.limit_seconds < 0.85 * two.bottleneck.limit_seconds
    with pytest.raises(PlannerError, match="links.cores"):
        load_links("h100-8gpu-400g", {"cores": 2})


def test_a_hosts_software_time_is_core_time_beside_its_copies():
    """On a host every rank is a process of that host: an actor's software seconds (per
    tensor, bucket, operation) also take the host's shared cores, added to the copies'
    core time, not run beside it for free. 0.15 s of copies on 2 cores plus 0.1 s of one
    rank's software is a 0.2 s phase bound by the cores (it was max(0.15, 0.1))."""
    from weightsync.tools.planner.linkmodel import Loads
    from weightsync.tools.planner.scenario import Placement
    model = model_from_tensors("one", [("w", (1024, 1024))])
    links = load_links("cpu-2core", {"links.device_mem.GBps": 10.0})
    pl = Placement(Scenario(model=model, links=links, trainer_gpus=1, replicas=1))
    loads = Loads(pl)
    loads.cpu(0, 3e9)                       # 3 GB of one-core copies: 0.15 s on 2 cores
    assert loads.result("copies").limit_seconds == pytest.approx(0.15)
    loads = Loads(pl)
    loads.cpu(0, 3e9)
    loads.work("trainer rank 0", 0.1)
    res = loads.result("copies and software")
    assert "cores" in res.limit and res.limit_seconds == pytest.approx(0.2)
    assert loads.busy["trainer rank 0"] == pytest.approx(0.1)
    # a GPU links file's ranks are not one host's processes: software stays the actor's
    gpu = Placement(Scenario(model=model, links=load_links("h100-8gpu-400g"),
                             trainer_gpus=1, replicas=1))
    loads = Loads(gpu)
    loads.work("trainer rank 0", 0.1)
    assert not loads.bytes and loads.result("software").limit_seconds == pytest.approx(0.1)


def test_collective_direct_size_is_the_engines_and_moves_the_cpu_broadcast(capsys):
    """``collective_direct_min`` defaults to the engine's own
    (``CollectiveOptions.direct_min_bytes``, default ``COLLECTIVE_DIRECT_MIN``): 12 MiB
    tensors go as their own broadcasts at the default, unpacked, so the 2-core host does not
    pay their pack and unpack copies; at 16 MiB it does. ``--collective-direct-mb`` sets it, and a
    negative one is refused naming the field."""
    from weightsync.transport.backends.collective import COLLECTIVE_DIRECT_MIN
    model = model_from_tensors("mid", [(f"l{i}.w", (3072, 2048)) for i in range(32)])
    links = load_links("cpu-2core", {"links.device_mem.GBps": 10.0, "collective.GBps": 4.0,
                                     # software takes the cores too: not this test's subject
                                     "software.tensor_us": 0, "software.bucket_us": 0,
                                     "software.op_us": 0})

    def secs(**kw):
        p = predict(Scenario(model=model, links=links, trainer_gpus=1, replicas=1,
                             strategies=("broadcast",), **kw))
        return p.results["broadcast"].bottleneck.limit_seconds
    assert Scenario(model=model, links=links, trainer_gpus=1, replicas=1).collective_direct_min \
        == COLLECTIVE_DIRECT_MIN == 8 << 20
    nbytes = 32 * 3072 * 2048 * 2
    assert secs() == pytest.approx(nbytes / 4e9, rel=0.05)
    assert secs(collective_direct_min=16 << 20) == pytest.approx(nbytes / 4e9 + nbytes / 10e9,
                                                                 rel=0.05)
    rc, out, err = run_cli(capsys, "--model", "kimi-k2", "--collective-direct-mb", "-1")
    assert rc != 0 and "collective_direct_min" in err and "Traceback" not in err
