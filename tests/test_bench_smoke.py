"""Smoke run of ``weightsync bench`` at tiny sizes: the JSON follows the schema and every
method (weightsync backends, baselines, limits) produced a time. No timing thresholds."""

import importlib.util
import json
import subprocess
import sys

import pytest

from weightsync.tools.bench import BenchConfig, parse_size, synthetic, validate
from weightsync.tools.bench.runner import DEFAULT_METHODS
from weightsync.tools.cli import main

NEEDS = {"ray": "ray", "safetensors-shm": "safetensors"}


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _script(name: str):
    """``benchmarks/<name>.py`` loaded as a module (the scripts are not a package)."""
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"weightsync_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod        # dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(300)
def test_bench_cli_smoke(tmp_path, capsys):
    out, png, md = tmp_path / "bench.json", tmp_path / "bench.png", tmp_path / "bench.md"
    args = ["bench", "--sizes", "4MiB", "--dtypes", "bfloat16", "--receivers", "1",
            "--bucket-size", "1MiB", "--warm", "2", "--no-hf", "--quiet", "--timeout", "60",
            "--json", str(out), "--markdown", str(md)]
    if _have("matplotlib"):
        args += ["--plot", str(png)]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    validate(doc)
    table = capsys.readouterr().out
    by_method = {r["method"]: r for r in doc["results"]}
    assert set(by_method) == set(DEFAULT_METHODS)
    for method, row in by_method.items():
        if method in NEEDS and not _have(NEEDS[method]):
            assert row["status"] == "unavailable", row
            continue
        assert row["status"] == "ok", (method, row["note"], row.get("traceback"))
        assert row["ok"], f"{method} delivered wrong bytes"
        assert row["warm_median_s"] > 0 and row["cold_s"] > 0 and len(row["warm_s"]) == 2
        assert row["rss"] and all(p["peak_bytes"] > 0 for p in row["rss"])
        assert method in table
    assert by_method["shm"]["paired"]["method"] == "memcpy"
    # the README's consumer beside the tuned rows: torch's default threads, limits paired
    assert by_method["shm"]["torch_threads"] == by_method["collective"]["torch_threads"] == 1
    # torch's default in a fresh process (earlier tests may have set this one's)
    default = int(subprocess.check_output(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"], timeout=120))
    for m, limit in (("shm@readme", "memcpy"), ("collective@readme", "gloo-flat")):
        assert by_method[m]["torch_threads"] == default, by_method[m]
        assert by_method[m]["paired"]["method"] == limit
    goals = {g["goal"] for g in doc["goals"]}
    assert {"shm_vs_memcpy", "collective_vs_gloo", "memory", "shm_vs_memcpy_readme",
            "collective_vs_gloo_readme"} <= goals
    if _have("matplotlib"):
        assert png.stat().st_size > 1000
    assert "| shm | weightsync |" in md.read_text()
    md2 = tmp_path / "again.md"               # re-render without running
    assert main(["bench", "--from-json", str(out), "--markdown", str(md2)]) == 0
    assert md2.read_text() == md.read_text()


@pytest.mark.timeout(300)
def test_bench_delta_methods(tmp_path):
    """``--methods delta+shm,shm --changed F``: the delta sync sends about F of the bytes,
    replays its inner plan after the first sync, and delivers the exact tensors."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--sizes", "8MiB", "--dtypes", "bfloat16", "--receivers", "1",
                 "--bucket-size", "1MiB", "--warm", "3", "--no-hf", "--quiet", "--timeout",
                 "60", "--methods", "delta+shm,shm", "--changed", "0.01", "--json",
                 str(out)]) == 0
    by_method = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    delta = by_method["delta+shm"]
    assert delta["status"] == "ok" and delta["ok"], delta
    info = delta["info"]
    assert info["mode"] == "delta" and info["resent"] == 0
    assert all(abs(f - 0.01) < 0.002 for f in info["changed_per_sync"][1:]), info
    assert info["record_bytes"] < 0.05 * info["dense_bytes"]
    assert info["layout_resent"][1:] == [0] * (len(info["layout_resent"]) - 1), info
    with pytest.raises(ValueError):
        BenchConfig(changed=1.5)


def test_workloads_and_config():
    assert parse_size("0.25") == 1 << 28 and parse_size("16MiB") == 16 << 20
    with pytest.raises(ValueError):
        parse_size("lots")
    w = synthetic(parse_size("8MiB"), "float32", bucket_size=1 << 20)
    assert w.largest > 1 << 20                      # one tensor bigger than the bucket
    assert 0.8 < w.nbytes / (8 << 20) < 1.25
    with pytest.raises(ValueError):
        BenchConfig(methods=("shm", "teleport"))
    with pytest.raises(ValueError):
        BenchConfig(receivers=(0,))
    with pytest.raises(ValueError):
        BenchConfig(warm=0)


@pytest.mark.skipif(not _have("transformers"), reason="transformers not installed")
def test_hf_workload_is_built_from_a_config():
    from weightsync.tools.bench import hf_qwen2
    w, why = hf_qwen2("bfloat16")
    assert w is not None, why
    params = w.nbytes // 2
    assert 400e6 < params < 600e6
    assert any(n.endswith("embed_tokens.weight") for n, _ in w.tensors)


@pytest.mark.timeout(240)
def test_multi_gpu_script_dry_run_on_cpu(tmp_path):
    """The device benchmark (benchmarks/multi_gpu.py) on gloo with 4 processes: the
    two-sender conformance case, the 1 -> 1 bench and the one-vs-two-senders run all
    deliver every tensor bit-exact. Guards the script between device runs."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "multi_gpu.py"
    cmd = [sys.executable, str(script), "--cpu", "4", "--out", str(tmp_path), "--gb", "0.05",
           "--buckets", "8", "--warm", "1", "--senders", "--senders-bucket", "8",
           "--cases", "two_senders"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((tmp_path / "multi_gpu.json").read_text())
    (case,) = doc["conformance"]
    for w in case["workers"]:
        assert "result" in w, w
        for step in w["result"]:
            assert "error" not in step and not step.get("missing") and not step.get("bad") \
                and not step.get("dupes"), (w["role"], step)
    assert doc["bench"][0]["exact"]
    one, two, scaling = doc["senders"]
    assert one["exact"] and two["exact"] and two["senders"] == 2
    sent = two["warm_bytes_per_sender"]      # each tensor from one owner, both ranks send
    assert abs(sum(sent) - two["GB"] * 1e9) < 1 and min(sent) > 0
    assert scaling["scaling_2_over_1"] > 0


@pytest.mark.timeout(180)
def test_gpu_bench_timeline_prints_every_warm_sync_on_cpu(tmp_path):
    """benchmarks/gpu_bench.py's plumbing check (--cpu-smoke) with --timeline: every warm
    sync of each configuration is printed, and timeline_costs.py reads each as a sync of
    that configuration; the logs stay out of the JSON. Guards the device runs' timelines."""
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    cmd = [sys.executable, str(bench / "gpu_bench.py"), "--cpu-smoke", "--layers", "2",
           "--scale", "16", "--warm", "3", "--timeline", "--rows", "ring",
           "--ring-buckets", "1,2", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    (tmp_path / "gpu_bench.txt").write_text(done.stdout)
    assert done.stdout.count("timeline: warm sync ") == 6
    got = _script("timeline_costs").syncs(str(tmp_path / "gpu_bench.txt"))
    assert [s.cfg["bucket_size"] >> 20 for s in got] == [1, 1, 1, 2, 2, 2]
    assert all(s.publishes > 1 and s.host_ms > 0 for s in got)
    doc = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert all(e["all_ok"] and len(e["warm_ms"]) == 3 and "timelines" not in e
               for e in doc["engine"])
    # --ring-probe (README, "Plan a sync"): the rows timeline_costs.py reads and no other
    probe = tmp_path / "probe"
    done = subprocess.run([*cmd[:7], "--warm", "1", "--ring-probe", "--rows", "into",
                           "--out", str(probe)], capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    cfgs = [e["cfg"] for e in json.loads((probe / "gpu_bench.json").read_text())["engine"]]
    assert [(c["bucket_size"] >> 20, c["sync"], c["consume"], c["zero_copy"]) for c in cfgs] \
        == [(b, "event", "into", False) for b in (256, 512, 1024, 4096)]
    assert done.stdout.count("timeline: warm sync 1 of 1") == 4


@pytest.mark.timeout(180)
def test_gpu_bench_kernels_row_times_the_codec_kernels_alone_bit_exact(tmp_path):
    """gpu_bench.py's kernels row on the host (Triton's interpreter): per fraction changed
    and program shape, the diff, encode and apply times and bit-exact records."""
    import os
    from pathlib import Path
    pytest.importorskip("triton")
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    cmd = [sys.executable, str(bench / "gpu_bench.py"), "--cpu-smoke", "--layers", "1",
           "--scale", "128", "--warm", "1", "--rows", "kernels", "--changed", "0.01,0.05",
           "--kernel-configs", "1024x4,256x8x1", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_bench.json").read_text())["kernels"]["rows"]
    assert [(r["changed"], r["block"], r["warps"]) for r in rows] == \
        [(f, b, w) for f in (0.01, 0.05) for b, w in ((1024, 4), (256, 8))]
    from weightsync.transport.codec import gpu
    assert [r["group_mib"] for r in rows[:2]] == [gpu.GROUP_BYTES >> 20, 1]   # default, 1 MiB
    assert all(r["ok"] and r["mark_ms"] > 0 and r["records_ms"] > 0 and r["apply_ms"] > 0
               for r in rows)
    assert rows[0]["record_bytes"] < rows[2]["record_bytes"] < rows[2]["bytes"]
    assert "codec kernels alone" in done.stdout


@pytest.mark.timeout(180)
def test_gpu_bench_delta_rows_send_records_and_the_plan_predicts_their_bytes(tmp_path):
    """gpu_bench.py's delta rows (plumbing checked with --cpu-smoke: delta+shm): the trainer
    changes --changed of its elements between syncs, every sync is bit-exact, warm syncs
    send the codec's records, and the planner's records of the bench's model at the
    fraction the codec measured are those bytes."""
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    cmd = [sys.executable, str(bench / "gpu_bench.py"), "--cpu-smoke", "--layers", "2",
           "--scale", "8", "--warm", "3", "--rows", "delta", "--bucket-mib", "8",
           "--changed", "0.01", "--profile", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads((tmp_path / "gpu_bench.json").read_text())["engine"]
    assert row["cfg"]["delta"] == 0.01 and row["all_ok"] and len(row["warm_ms"]) == 3
    assert row["rx_metrics"]["applied"] > 0 and "round1" in row["rx_metrics"]["phases"]
    for role in ("trainer", "rollout"):      # --profile: one more sync, its top functions
        text = (tmp_path / f"profile-delta-True-1-0-changed-receive-into-{role}.txt").read_text()
        assert "codec" in text and "Ordered by: cumulative time" in text
    codec = row["metrics"]["codec"]
    assert codec["mode"] == "delta" and codec["resent"] == 0
    assert 0 < codec["record_bytes"] < codec["dense_bytes"] / 20
    assert 0.009 < codec["changed_fraction"] <= 0.01
    from weightsync.tools.planner.delta import records
    from weightsync.tools.planner.model import model_from_tensors
    from weightsync.tools.planner.rules import planned_tensors
    shapes = _script("gpu_bench").model_shapes(2, 8)
    pts, _ = planned_tensors(model_from_tensors("smoke", shapes), 1, 0, "bfloat16", "bfloat16")
    _, rec, dense = records(pts, codec["changed_fraction"], 1)
    assert dense == 0 and rec == pytest.approx(codec["record_bytes"], rel=0.03)


@pytest.mark.timeout(120)
def test_cross_memory_read_limit(tmp_path):
    """``cma-raw``: every receiver reads the trainer's flat buffer with cross-memory reads;
    a time per step for 1 and 2 receivers, the rate ``weightsync plan --fit`` takes as
    ``ring.direct_GBps``."""
    out = tmp_path / "cma.json"
    assert main(["bench", "--sizes", "16MiB", "--dtypes", "bfloat16", "--receivers", "1,2",
                 "--warm", "2", "--no-hf", "--quiet", "--timeout", "60", "--methods",
                 "cma-raw", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["receivers"] for r in rows] == [1, 2]
    for row in rows:
        assert row["status"] == "ok", (row["note"], row.get("traceback"))
        assert row["warm_median_s"] > 0 and len(row["warm_s"]) == 2


@pytest.mark.timeout(180)
def test_nixl_and_its_raw_read_limit(tmp_path):
    """``nixl`` paired with ``nixl-raw``: both move the bytes, the raw READ served by a
    trainer agent that a poller progresses (no NIXL progress thread by default)."""
    pytest.importorskip("nixl")
    out = tmp_path / "nixl.json"
    assert main(["bench", "--sizes", "8MiB", "--dtypes", "bfloat16", "--receivers", "1",
                 "--warm", "2", "--no-hf", "--quiet", "--timeout", "60", "--methods",
                 "nixl,nixl-raw", "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"nixl", "nixl-raw"}
    for row in rows.values():
        assert row["status"] == "ok", (row["note"], row.get("traceback"))
        assert row["warm_median_s"] > 0 and len(row["warm_s"]) == 2
    assert rows["nixl"]["paired"]["method"] == "nixl-raw"
    assert len(rows["nixl"]["paired"]["warm_s"]) == 2


@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_verl_baseline_script_syncs_bit_exact_on_one_gpu(tmp_path):
    """benchmarks/verl_baseline.py, the baseline docs/benchmarks.md quotes: a trainer and a
    rollout process on one GPU, tensors bigger than the bucket chunked across buckets;
    every sync checked against the trainer's checksums, timed beside a flat copy."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "verl_baseline.py"
    done = subprocess.run([sys.executable, str(script), "--layers", "2", "--scale", "8",
                           "--bucket-mib", "8", "--warm", "2", "--timeout", "120",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((tmp_path / "verl_baseline.json").read_text())
    assert res["all_ok"] and len(res["warm_ms"]) == 2 and res["flat_ms"] > 0
    assert res["bytes"] > 8 << 20 and "checks ok" in done.stdout


def test_gpu_bench_delta_rows_at_each_launch_size():
    """--delta-group-mib: a delta row per fraction changed and per MiB diffed per launch
    (each row's processes set the codec's launch size; none: the library's)."""
    import argparse
    bench = _script("gpu_bench")
    args = argparse.Namespace(rows="into,delta", changed="0.005,0.05", bucket_mib=None,
                              delta_group_mib="512,2048", ring_buckets="")
    got = [(name, cfg.get("delta"), cfg.get("group_mib")) for name, cfg in bench.configs(args)]
    assert got[0] == ("default, receive_into", None, None)
    assert [(f, g) for _, f, g in got[1:]] == [(0.005, 512), (0.005, 2048), (0.05, 512),
                                               (0.05, 2048)]
    assert got[2][0] == "delta=True, 0.5% changed, receive_into, 2048 MiB per launch"
    args.delta_group_mib = ""
    assert [cfg.get("group_mib") for _, cfg in bench.configs(args)] == [None] * 3
