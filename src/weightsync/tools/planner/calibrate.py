"""Predicted vs measured: every recorded benchmark run the planner can model, predicted.

Owns :func:`run` (the cases and their rows), :func:`format_text` and
:func:`format_markdown`. Measurements come from ``benchmarks/results/`` of the checkout:
the runs of :data:`CPU_RUNS` (``shm``, ``shm-buckets``, ``shm-direct``, ``collective``;
1/2/4 receivers; the bench's own workloads, :mod:`weightsync.tools.bench.workloads`, on
the ``cpu-2core`` preset), the ``cpu-nixl-*`` runs of :data:`NIXL_RUNS` (``nixl``: the
``p2p`` strategy as the backend ran then, with the preset and with each run's own raw
READ / memcpy rates as the links),
``gpu-h200-2026-11-29/bench_final.json`` and ``gpu-h200-2026-12-01`` (``cuda_ipc`` bucket
ring, one H200: the ``ring`` strategy, colocated), ``multi-gpu-h200x2-2026-11-29`` and
``multi-gpu-h200x4-2026-11-29`` (``collective`` on NCCL: 1 -> 1, 1 -> 2, 2 senders -> 2;
the ``broadcast`` strategy, packed on one node). GPU model shapes are taken from the
benchmark scripts themselves (``benchmarks/gpu_bench.py``, ``benchmarks/multi_gpu.py``,
loaded by path). The presets' numbers and where each comes from are in their files; the
limits they were read from (memcpy, raw gloo / NCCL broadcast, one device copy) are not
calibration cases. Not modelled: ``cuda_ipc`` zero-copy, the verl-style baseline, Ray and
the other baselines.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from typing import Any, Callable, Optional

from weightsync.tools.planner.errors import PlannerError
from weightsync.tools.planner.links import Links, load_links
from weightsync.tools.planner.model import ModelSpec, model_from_tensors
from weightsync.tools.planner.predict import predict
from weightsync.tools.planner.scenario import Scenario

__all__ = ["run", "format_text", "format_markdown", "results_dir", "GOAL", "GROUPS"]

GOAL = 0.25
_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))


def results_dir() -> str:
    path = os.path.join(_ROOT, "benchmarks", "results")
    if not os.path.isdir(path):
        raise PlannerError("calibrate", f"no benchmarks/results under {_ROOT}: run from a "
                                        "checkout of weightsync")
    return path


def _json(*parts: str) -> dict:
    path = os.path.join(results_dir(), *parts)
    with open(path) as f:
        return json.load(f)


def _script(name: str) -> Any:
    path = os.path.join(_ROOT, "benchmarks", name + ".py")
    spec = importlib.util.spec_from_file_location(f"weightsync_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(case: str, strategy: str, sc: Scenario, measured: float, source: str,
         check: Optional[Callable] = None) -> dict:
    p = predict(sc)
    r = p.results[strategy]
    row = {"case": case, "strategy": strategy, "predicted_s": r.seconds,
           "measured_s": measured, "error": r.seconds / measured - 1.0,
           "limited_by": f"{r.bottleneck.name}: {r.bottleneck.limit}", "source": source}
    row["within_goal"] = abs(row["error"]) <= GOAL
    if check is not None:
        row.update(check(r))
    return row


def _cpu_model(rec: dict) -> ModelSpec:
    from weightsync.tools.bench.workloads import hf_qwen2, parse_size, synthetic
    if rec["workload"].startswith("hf-qwen2"):
        w, _ = hf_qwen2(rec["dtype"])
    else:
        w = synthetic(parse_size(rec["workload"].split("-", 1)[1]), rec["dtype"],
                      bucket_size=rec["bucket_size"])
    if w is None or len(w.tensors) != rec["tensors"] or w.nbytes != rec["bytes"]:
        raise PlannerError("calibrate", f"workload {rec['workload']} is not what was measured")
    return model_from_tensors(w.name, w.tensors, note=w.note)


#: The CPU bench runs of ``shm`` / ``collective`` (folder, file, label): the 11-29 run of
#: that day's code (a loaded box, load average ~5), and the 12-03 run of the code with the
#: direct window (`benchmarks/results/cpu-calib-2026-12-03/`).
CPU_RUNS = (("cpu-2026-11-29", "bench.json", "11-29"),
            ("cpu-calib-2026-12-03", "bench.json", "12-03"))


def _cpu_cases() -> list[dict]:
    base = load_links("cpu-2core")
    variants: dict[str, tuple[str, Links]] = {
        "shm": ("ring", base), "collective": ("broadcast", base),
        "shm-buckets": ("ring", dataclasses.replace(base, direct_min_bytes=0)),
        "shm-direct": ("ring", dataclasses.replace(base, direct_max_receivers=64))}
    rows, models = [], {}
    for folder, name, label in CPU_RUNS:
        if not os.path.exists(os.path.join(results_dir(), folder, name)):
            continue
        for rec in _json(folder, name)["results"]:
            if rec["status"] != "ok" or rec["method"] not in variants:
                continue
            strategy, links = variants[rec["method"]]
            if rec["workload"] not in models:
                models[rec["workload"]] = _cpu_model(rec)
            sc = Scenario(model=models[rec["workload"]], links=links, trainer_gpus=1,
                          replicas=rec["receivers"], bucket_size=rec["bucket_size"],
                          src_dtype=rec["dtype"], dst_dtype=rec["dtype"],
                          strategies=(strategy,))
            rows.append(_row(f"CPU {rec['workload']} {rec['method']} R={rec['receivers']} "
                             f"({label})", strategy, sc, rec["warm_median_s"],
                             f"{folder}/{name} warm_median_s"))
    return rows


def _h200_cases() -> list[dict]:
    links, rows = load_links("h200-8gpu-400g"), []
    for folder, name in (("gpu-h200-2026-11-29", "bench_final.json"),
                         ("gpu-h200-2026-12-01", "gpu_bench.json")):
        if not os.path.exists(os.path.join(results_dir(), folder, name)):
            continue
        doc = _json(folder, name)
        model = model_from_tensors("llama3-8b-shapes",
                                   _script("gpu_bench").model_shapes(doc["layers"]))
        for e in doc["engine"]:
            cfg = e["cfg"]
            if cfg["zero_copy"]:
                continue
            sc = Scenario(model=model, links=links, trainer_gpus=1, replicas=1,
                          placement="colocated", bucket_size=cfg["bucket_size"],
                          strategies=("ring",))
            rows.append(_row(f"H200 cuda_ipc ring {cfg['bucket_size'] >> 20} MiB "
                             f"({cfg['sync']}, {folder[-10:]})", "ring", sc,
                             e["median_ms"] / 1e3, f"{folder}/{name} median_ms"))
    return rows


def _sender_bytes(measured: list) -> Callable:
    def check(r) -> dict:
        pred = [int(x) for x in r.source_bytes]
        return {"bytes_per_sender": {"predicted": pred, "measured": measured}}
    return check


def _nccl_cases() -> list[dict]:
    spec = _script("multi_gpu").model_spec(16)
    model = model_from_tensors("llama70b-shaped-16gb", spec)
    links, rows = load_links("h200-8gpu-400g"), []
    runs = [("multi-gpu-h200x2-2026-11-29", "bench.json", "2 x H200"),
            ("multi-gpu-h200x4-2026-11-29", "multi_gpu.json", "4 x H200")]
    for folder, name, label in runs:
        doc = _json(folder, name)
        for b in doc["bench"]:
            sc = Scenario(model=model, links=links, trainer_gpus=1, replicas=1,
                          placement="packed", bucket_size=b["bucket_MiB"] << 20,
                          strategies=("broadcast",))
            rows.append(_row(f"{label} collective 1 -> 1, {b['bucket_MiB']} MiB", "broadcast",
                             sc, b["warm_s"], f"{folder}/{name} bench warm_s"))
        for s in doc.get("senders", []):
            if "senders" not in s:
                continue
            sc = Scenario(model=model, links=links, trainer_gpus=s["senders"],
                          trainer_shard="full", replicas=s["receivers"], placement="packed",
                          bucket_size=1 << 30, strategies=("broadcast",))
            rows.append(_row(f"{label} collective {s['senders']} sender(s) -> "
                             f"{s['receivers']}, 1024 MiB", "broadcast", sc, s["warm_s"],
                             f"{folder}/{name} senders warm_s",
                             _sender_bytes(s["warm_bytes_per_sender"])))
    return rows


#: the recorded nixl runs: (folder, file, pipelined, serve) as the backend then ran
NIXL_RUNS = (("cpu-nixl-2026-12-01", "bench_1g.json", False, "staging"),
             ("cpu-nixl-2026-12-01", "bench_1g_run2.json", False, "staging"),
             ("cpu-nixl-pipelined-2026-12-02", "bench_1g.json", True, "staging"),
             ("cpu-nixl-pipelined-2026-12-02", "bench_1g_pipeline_off.json", False, "staging"),
             ("cpu-nixl-pipelined-2026-12-02", "bench_1g_serve_auto.json", True, "auto"),
             ("cpu-nixl-auto-2026-12-03", "bench_1g.json", True, "auto"))


def _nixl_cases() -> list[dict]:
    """``nixl`` 1 GiB 1 -> 1 on CPU, each run as the backend ran then (pipelined or not,
    staging or serving its own storage): with the preset, and with the run's own limits
    (its raw NIXL READ as the cross-process link, its memcpy as the copy rate)."""
    rows = []
    for folder, name, pipelined, serve in NIXL_RUNS:
        if not os.path.exists(os.path.join(results_dir(), folder, name)):
            continue
        doc = _json(folder, name)
        by = {r["method"]: r for r in doc["results"] if r["status"] == "ok"}
        if "nixl" not in by:
            continue
        rec = by["nixl"]
        model = _cpu_model(rec)
        variants = [("preset", {})]
        if "nixl-raw" in by and "memcpy" in by:
            # the raw READ run right before each nixl step in the same processes, where
            # the bench paired them (it ran ~1.7 x slower there than in processes of its
            # own: BENCHMARKS.md), else the raw READ's own run
            paired = rec.get("paired") or {}
            raw_s, which = (paired["warm_median_s"], "paired raw READ") \
                if paired.get("method") == "nixl-raw" else \
                (by["nixl-raw"]["warm_median_s"], "raw READ run")
            variants.append((f"links from this run's limits ({which})", {
                "links.intra.GBps": rec["bytes"] / raw_s / 1e9,
                "links.device_mem.GBps": rec["bytes"] / by["memcpy"]["warm_median_s"] / 1e9}))
        how = f"{'pipelined' if pipelined else 'not pipelined'}, {serve}"
        for label, sets in variants:
            sc = Scenario(model=model, links=load_links("cpu-2core", sets), trainer_gpus=1,
                          replicas=rec["receivers"], bucket_size=rec["bucket_size"],
                          strategies=("p2p",), pipelined=pipelined, serve=serve)
            rows.append(_row(f"CPU {rec['workload']} nixl R={rec['receivers']} ({folder[9:]}/"
                             f"{name}, {how}, {label})", "p2p", sc, rec["warm_median_s"],
                             f"{folder}/{name} warm_median_s"))
    return rows


GROUPS = {"cpu": lambda: _cpu_cases(), "nixl": lambda: _nixl_cases(),
          "h200": lambda: _h200_cases(), "nccl": lambda: _nccl_cases()}


def run(groups: tuple[str, ...] = tuple(GROUPS)) -> dict:
    """Every case of ``groups``, predicted and compared (``error`` = predicted /
    measured - 1)."""
    rows = [row for g in groups for row in GROUPS[g]()]
    within = sum(r["within_goal"] for r in rows)
    return {"schema": "weightsync.plan.calibration/1", "goal": GOAL, "rows": rows,
            "within_goal": within, "cases": len(rows),
            "not_modelled": ["cuda_ipc zero-copy", "verl-style cuda_ipc baseline",
                             "ray, gloo-per-tensor, safetensors-shm baselines",
                             "nixl VRAM -> VRAM on one H200 (UCX takes a host path there)"]}


def _lines(doc: dict, sep: str) -> list[str]:
    out = []
    for r in doc["rows"]:
        extra = ""
        if "bytes_per_sender" in r:
            b = r["bytes_per_sender"]
            extra = f" (bytes per sender predicted {b['predicted']}, measured {b['measured']})"
        cells = [r["case"], f"{r['predicted_s'] * 1e3:.1f}", f"{r['measured_s'] * 1e3:.1f}",
                 f"{r['error'] * 100:+.0f} %", "yes" if r["within_goal"] else "**no**",
                 r["limited_by"] + extra]
        out.append(sep.join(cells))
    return out


def format_text(doc: dict) -> str:
    head = "case | predicted ms | measured ms | error | within 25 % | predicted bottleneck"
    tail = (f"{doc['within_goal']} of {doc['cases']} cases within +-{doc['goal'] * 100:.0f} %; "
            f"not modelled: {', '.join(doc['not_modelled'])}")
    return "\n".join([head] + _lines(doc, " | ") + [tail])


def format_markdown(doc: dict) -> str:
    head = ["| case | predicted ms | measured ms | error | within +-25 % | predicted bottleneck |",
            "| --- | ---: | ---: | ---: | --- | --- |"]
    body = [f"| {line} |" for line in _lines(doc, " | ")]
    return "\n".join(head + body + ["", f"{doc['within_goal']} of {doc['cases']} cases "
                                         f"within +-{doc['goal'] * 100:.0f} %."])
