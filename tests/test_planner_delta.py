"""Tests of delta syncs in ``weightsync plan`` (weightsync.tools.planner.delta): the records
on the wire are the codec's own (its encode makes records of exactly the planned size), the
codec's encode and apply are priced from ``links.codec`` as a pipeline over the record
buckets, a sharded trainer gathers first and every worker takes every record whole, bad
input is a PlannerError naming the field."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from weightsync.tools.planner import PlannerError
from weightsync.tools.cli import main as weightsync_main
from weightsync.tools.planner.delta import RECORD_DTYPE, records
from weightsync.tools.planner.links import PRESET_DIR, load_links
from weightsync.tools.planner.model import model_from_tensors
from weightsync.tools.planner.predict import predict
from weightsync.tools.planner.rules import planned_tensors
from weightsync.tools.planner.scenario import Scenario
from weightsync.transport.codec import delta as codec_delta
from weightsync.transport.codec.engine import DELTA_BUCKET

pytestmark = pytest.mark.timeout(120)

SHAPES = (("a.weight", (64, 96)), ("b.weight", (300000,)), ("c.bias", (96,)),
          ("d.weight", (7, 5)), ("e.weight", (512, 512)))


def _model(shapes=SHAPES):
    return model_from_tensors("toy", shapes)


def _scenario(**kw) -> Scenario:
    base = dict(model=_model(), links=load_links("cpu-2core"), trainer_gpus=1, replicas=1,
                bucket_size=64 << 20, strategies=("ring", "broadcast", "p2p"), delta=0.01)
    base.update(kw)
    return Scenario(**base)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("changed", [0.0, 0.001, 0.01, 0.3, 0.9])
def test_the_planned_records_are_what_the_codec_encodes(dtype, changed):
    """For each tensor, the codec's encode of a tensor with that many changed elements makes
    a record of the size the plan sends (or none: the plan sends the tensor dense)."""
    pts, _ = planned_tensors(_model(), 1, 0, dtype, dtype)
    recs, rec_bytes, dense = records(pts, changed, workers=1)
    gen = torch.Generator().manual_seed(0)
    total_rec = total_dense = 0
    for pt, rec in zip(pts, recs):
        base = torch.randn(pt.shape, generator=gen).to(getattr(torch, dtype))
        new = base.clone()
        n = base.numel()
        m = round(changed * n)
        flat = new.view(-1)
        flat[torch.randperm(n, generator=gen)[:m]] += 1.0
        assert int((new.view(-1) != base.view(-1)).sum()) == m
        made, _ = codec_delta.encode(new, base)
        small = n * base.element_size() <= 256          # the codec's SMALL: always dense
        if made is None or small:
            assert rec.src_dtype == dtype and rec.shape == pt.shape, (pt.name, changed)
            total_dense += n * base.element_size()
        else:
            assert rec.src_dtype == RECORD_DTYPE and rec.shape == (made.numel(),), pt.name
            total_rec += made.numel()
    assert (rec_bytes, dense) == (total_rec, total_dense)
    assert rec_bytes or changed >= 0.3 or dtype == "float32" and changed > 0.5


def test_the_record_bytes_of_the_bench_workload_are_the_codecs():
    """The bench's 256 MiB bf16 workload at 0.5 % changed (``weightsync bench --methods
    delta+shm,delta+collective --changed 0.005``): a warm sync sends 4,321,328 bytes of
    records, the codec's own count for that workload; the plan sends the same to every
    receiver, over the ring and the broadcast alike (the bench changes round(fraction x n)
    elements of each tensor)."""
    from weightsync.tools.bench.workloads import synthetic
    w = synthetic(256 << 20, "bfloat16", bucket_size=64 << 20)
    model = model_from_tensors(w.name, w.tensors)
    for receivers in (1, 2):
        p = predict(_scenario(model=model, replicas=receivers, strategies=("ring", "broadcast"),
                              delta=0.005))
        for name in ("ring", "broadcast"):
            assert p.delta[name]["record_bytes"] == 4321328
            assert p.results[name].dest_bytes == [4321328] * receivers
    assert "encode" in p.results["ring"].bottleneck.limit


def test_the_codec_is_a_pipeline_over_record_buckets():
    """Records of one bucket: encode everything, then apply everything; records over many
    buckets: the slower stage plus one part of the other. The trainer's encode and each
    receiver's apply are priced at links.codec's rates."""
    links = load_links("cpu-2core")
    enc, app = links.codec["encode"], links.codec["apply"]
    one = predict(_scenario(strategies=("ring",), delta=0.001))
    d = one.delta["ring"]
    assert d["record_buckets"] == 1
    dense = sum(math.prod(s) * 2 for _, s in SHAPES)
    assert d["dense_bytes"] == dense
    assert d["encode_s"] == pytest.approx(dense / enc) and d["apply_s"] == pytest.approx(
        dense / app)
    assert d["codec_s"] == pytest.approx(d["encode_s"] + d["apply_s"])
    # a big model whose records fill many buckets (a tenth of its elements change)
    big = model_from_tensors("big", [(f"l{i}.weight", (4096, 4096)) for i in range(64)])
    many = predict(_scenario(model=big, strategies=("ring",), delta=0.1)).delta["ring"]
    assert many["record_buckets"] > 8
    assert many["record_bytes"] > 8 * min(_scenario().bucket_size, DELTA_BUCKET)
    slow, fast = max(many["encode_s"], many["apply_s"]), min(many["encode_s"], many["apply_s"])
    assert many["codec_s"] == pytest.approx(slow + fast / many["record_buckets"])
    r = predict(_scenario(model=big, strategies=("ring",), delta=0.1)).results["ring"]
    assert r.phases[0].name.startswith("delta: encode + apply")
    assert r.seconds > many["codec_s"]              # the records' transport after it


def test_a_sharded_trainer_gathers_dense_and_tp_workers_take_every_record_whole():
    """64 FSDP2 ranks into TP-2 workers: the delta sync starts with the dense export's
    gather, and both workers of a replica take the whole records (the codec serves no
    shards), each with a note of the base copy it keeps."""
    model = model_from_tensors("tp", [(f"model.layers.{i}.mlp.down_proj.weight", (2048, 4096))
                                      for i in range(4)])
    sc = Scenario(model=model, links=load_links("h100-8gpu-400g"), trainer_gpus=16,
                  replicas=2, tp=2, strategies=("broadcast", "p2p"), delta=0.005)
    p = predict(sc)
    dense = predict(dataclasses.replace(sc, delta=None))
    for name in ("broadcast", "p2p"):
        r = p.results[name]
        assert r.phases[0].name.startswith("gather"), [ph.name for ph in r.phases]
        assert r.phases[1].name.startswith("delta: encode + apply")
        rec = p.delta[name]["record_bytes"]
        assert len(set(r.dest_bytes)) == 1 and r.dest_bytes[0] == pytest.approx(rec)
        assert any("whole base copy" in n for n in r.notes)
        # records are far fewer bytes than the dense sync's
        assert sum(r.dest_bytes) < sum(dense.results[name].dest_bytes) / 10
    assert p.bound["bytes"] == pytest.approx(p.delta["p2p"]["record_bytes"])


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.1", float("nan")])
def test_a_bad_fraction_is_an_error_naming_delta(bad):
    with pytest.raises(PlannerError) as e:
        _scenario(delta=bad)
    assert e.value.field == "delta"


def test_links_without_a_codec_or_with_a_bad_rate_name_the_field():
    with open(f"{PRESET_DIR}/cpu-2core.json") as f:
        doc = json.load(f)
    doc.pop("codec")
    with pytest.raises(PlannerError) as e:
        predict(_scenario(links=load_links(doc)))
    assert e.value.field == "links.codec.encode_GBps"
    assert predict(_scenario(links=load_links(doc), delta=None)).results["ring"].seconds > 0
    doc["codec"] = {"encode_GBps": 3.0, "apply_GBps": -1}
    with pytest.raises(PlannerError) as e:
        load_links(doc)
    assert e.value.field == "links.codec.apply_GBps"


def test_the_cli_takes_delta_and_writes_its_figures(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen2", "hidden_size": 256,
                               "intermediate_size": 512, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2,
                               "vocab_size": 1024}))
    out = tmp_path / "p.json"
    rc = weightsync_main(["plan", "--model", str(cfg), "--trainer-gpus", "2", "--replicas", "2",
                    "--links", "h100-8gpu-400g", "--delta", "0.01", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["scenario"]["delta"] == 0.01
    for name in ("p2p", "broadcast"):
        d = doc["strategies"][name]["delta"]
        assert 0 < d["record_bytes"] < d["dense_bytes"] and d["codec_s"] > 0
    assert "delta: encode + apply" in capsys.readouterr().out
    assert weightsync_main(["plan", "--model", str(cfg), "--links", "h100-8gpu-400g",
                            "--delta", "2"]) == 2
    assert "delta" in capsys.readouterr().err


def test_the_gpu_presets_price_the_codec_by_the_weights_it_reads():
    """On a GPU the codec's diff reads the weights and the base once, and each changed
    element adds a little: both GPU presets carry a byte rate for each side and a small cost
    per change, so ten times the changed elements take more, but not twice as long."""
    for preset in ("h100-8gpu-400g", "h200-8gpu-400g"):
        codec = load_links(preset).codec
        assert math.isfinite(codec["encode"]) and math.isfinite(codec["apply"])
        assert codec["encode_ns"] > 0
    model = model_from_tensors("8b", [(f"model.layers.{i}.mlp.down_proj.weight", (4096, 14336))
                                      for i in range(8)])
    sc = Scenario(model=model, links=load_links("h100-8gpu-400g"), trainer_gpus=1,
                  replicas=1, placement="colocated", strategies=("ring",), delta=0.005)
    fast = predict(sc).delta["ring"]["codec_s"]
    slow = predict(dataclasses.replace(sc, delta=0.05)).delta["ring"]["codec_s"]
    assert fast < slow < 2 * fast


def test_a_codec_side_needs_a_rate_or_a_cost_per_change():
    with open(f"{PRESET_DIR}/cpu-2core.json") as f:
        doc = json.load(f)
    doc["codec"] = {"encode_GBps": 3.0}
    with pytest.raises(PlannerError) as e:
        load_links(doc)
    assert e.value.field == "links.codec.apply_GBps"
    doc["codec"] = {"encode_GBps": 3.0, "apply_ns": 10}
    c = load_links(doc).codec
    assert c["apply"] == math.inf and c["apply_ns"] == pytest.approx(1e-8)
    assert c["encode_ns"] == 0.0


def test_workers_apply_at_their_own_nodes_codec_costs():
    """--rollout-links: the trainer encodes at its nodes' codec costs, the workers apply at
    theirs."""
    model = model_from_tensors("m", [(f"model.layers.{i}.mlp.down_proj.weight", (1024, 1024))
                                     for i in range(4)])
    base = Scenario(model=model, links=load_links("h100-8gpu-400g"), trainer_gpus=8,
                    replicas=2, strategies=("p2p",), delta=0.01)
    with open(f"{PRESET_DIR}/h100-8gpu-400g.json") as f:
        codec = json.load(f)["codec"]
    slow = load_links("h200-8gpu-400g", {"codec.apply_GBps": codec["apply_GBps"] / 10,
                                         "codec.apply_ns": codec.get("apply_ns", 0) * 10})
    a = predict(base).delta["p2p"]
    b = predict(dataclasses.replace(base, rollout_links=slow)).delta["p2p"]
    assert b["encode_s"] == pytest.approx(a["encode_s"])
    assert b["apply_s"] == pytest.approx(10 * a["apply_s"], rel=1e-6)
