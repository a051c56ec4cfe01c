"""Bench report: JSON document, goal ratios, terminal table and plot.

Schema (``"schema": "weightsync-bench/1"``): ``machine``, ``config``, ``results`` (one row
per workload x dtype x receivers x method: ``cold_s``, ``warm_s``, ``warm_median_s``,
``gbps``, ``rss`` per process, ``status`` = ok | skipped | unavailable | failed, ``note``),
``goals`` (each goal of the issue per case: ``ratio``, ``target``, ``met``), ``notes``.
All ratios come from the same run.
"""

from __future__ import annotations

import os
import platform
import socket
from typing import Any, Optional

from weightsync.tools.bench.workloads import tensors_of

__all__ = ["build_report", "format_table", "format_goals", "format_markdown", "plot", "SCHEMA",
           "machine_info", "validate"]

SCHEMA = "weightsync-bench/1"
WS_METHODS = ("shm", "collective", "nixl")
RESULT_KEYS = ("workload", "dtype", "bytes", "receivers", "method", "kind", "status", "note",
               "cold_s", "warm_s", "warm_median_s", "gbps", "rss", "max_extra_rss_bytes", "ok")


def machine_info() -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, StopIteration):
        pass
    import torch
    return {"hostname": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(),
            "memory_bytes": mem, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "loadavg": list(os.getloadavg())}


def _find(results: list[dict], method: str, workload: str, dtype: str,
          receivers: int) -> Optional[dict]:
    for r in results:
        if (r["method"], r["workload"], r["dtype"], r["receivers"]) == \
                (method, workload, dtype, receivers) and r["status"] == "ok":
            return r
    return None


def _cases(results: list[dict]) -> list[tuple[str, str, int]]:
    seen = []
    for r in results:
        key = (r["workload"], r["dtype"], r["receivers"])
        if key not in seen:
            seen.append(key)
    return seen


def _goal(gid: str, text: str, case: str, ratio: Optional[float], target: float,
          higher: bool, detail: str = "") -> dict:
    met = None if ratio is None else (ratio >= target if higher else ratio <= target)
    return {"goal": gid, "text": text, "case": case, "ratio": ratio, "target": target,
            "higher_is_better": higher, "met": met, "detail": detail}


def _speed_ratio(x: dict, limit: Optional[dict], name: str) -> tuple[Optional[float], str]:
    """x's speed over the limit's: step by step if the limit ran paired with x."""
    p = x.get("paired")
    if p and p.get("method") == name:
        return p["ratio_median"], f"median of {len(p['warm_s'])} paired steps"
    if limit:
        return x["gbps"] / limit["gbps"], "separate runs"
    return None, ""


#: speed goals: (id, method, its limit, target ratio, one receiver only, text); the
#: ``@readme`` rows are the same syncs consumed as the README shows (torch's default threads)
_SPEED_GOALS = (
    ("shm_vs_memcpy", "shm", "memcpy", 0.8, True,
     "shm warm >= 0.8 x memcpy (bytes/s), 1 receiver"),
    ("collective_vs_gloo", "collective", "gloo-flat", 0.9, False,
     "collective >= 0.9 x raw gloo broadcast"),
    ("shm_vs_memcpy_readme", "shm@readme", "memcpy", 0.8, True,
     "shm >= 0.8 x memcpy, README's consumer"),
    ("collective_vs_gloo_readme", "collective@readme", "gloo-flat", 0.9, False,
     "collective >= 0.9 x raw gloo, README's consumer"),
    ("shm_shared_vs_memcpy", "shm-shared", "memcpy", 0.8, True,
     "shm, trainer's tensors shared (model.share_memory()) >= 0.8 x memcpy"),
    ("shm_shared_vs_memcpy_readme", "shm-shared@readme", "memcpy", 0.8, True,
     "shm, trainer's tensors shared, README's consumer >= 0.8 x memcpy"),
    ("shm_push_vs_memcpy", "shm-push", "memcpy", 0.8, True,
     "shm, receivers' tensors shared (the trainer writes into them) >= 0.8 x memcpy"),
    ("shm_push_vs_memcpy_readme", "shm-push@readme", "memcpy", 0.8, True,
     "shm, receivers' tensors shared, README's consumer >= 0.8 x memcpy"),
)


def compute_goals(results: list[dict], bucket: int) -> list[dict]:
    goals = []
    for w, d, r in _cases(results):
        case = f"{w} {d} R={r}"
        for gid, method, limit, target, single, text in _SPEED_GOALS:
            x = _find(results, method, w, d, r)
            if not x or (single and r != 1):
                continue
            # a README row's limit ran paired under its threads: no other row stands for it
            lim = None if method.endswith("@readme") else _find(results, limit, w, d, r)
            ratio, how = _speed_ratio(x, lim, limit)
            if ratio is not None:
                goals.append(_goal(gid, text, case, ratio, target, True, how))
        shm, shm1 = _find(results, "shm", w, d, r), _find(results, "shm", w, d, 1)
        if r == 4 and shm and shm1:
            goals.append(_goal("shm_scaling", "shm time grows <= 1.5x from 1 to 4 receivers",
                               case, shm["warm_median_s"] / shm1["warm_median_s"], 1.5, False))
        nx, raw = _find(results, "nixl", w, d, r), _find(results, "nixl-raw", w, d, r)
        if nx:
            ratio, how = _speed_ratio(nx, raw, "nixl-raw")
            if ratio is not None:
                goals.append(_goal("nixl_vs_raw", "nixl >= 0.8 x a raw NIXL READ of one flat "
                                   "region", case, ratio, 0.8, True, how))
        best = min((x for x in (_find(results, m, w, d, r) for m in WS_METHODS) if x),
                   key=lambda x: x["warm_median_s"], default=None)
        if best and w.endswith("-1GiB"):
            for base, target in (("ray", 5.0), ("gloo-per-tensor", 3.0)):
                b = _find(results, base, w, d, r)
                if b:
                    goals.append(_goal(f"best_vs_{base}", f"best backend >= {target:g}x {base} "
                                       "at 1 GiB", case, b["warm_median_s"] / best["warm_median_s"],
                                       target, True, f"best = {best['method']}"))
            for m in WS_METHODS:
                x = _find(results, m, w, d, r)
                if x:
                    goals.append(_goal("cold_vs_warm", "cold sync <= 2 x warm sync at 1 GiB",
                                       f"{case} {m}", x["cold_s"] / x["warm_median_s"], 2.0,
                                       False))
        for m in WS_METHODS:
            x = _find(results, m, w, d, r)
            if x:
                limit = 3 * bucket
                worst = max(x["rss"], key=lambda p: p["extra_bytes"])
                goals.append(_goal("memory", "extra RSS per process <= 2 x bucket + one chunk "
                                   "(chunk <= bucket)", f"{case} {m}",
                                   worst["extra_bytes"] / limit, 1.0, False,
                                   f"worst: {worst['role']} rank {worst['rank']} "
                                   f"+{worst['extra_bytes'] / 2**20:.0f} MiB, limit "
                                   f"{limit / 2**20:.0f} MiB"))
    return goals


def build_report(cfg: Any, results: list[dict], notes: list[str], *, seconds: float) -> dict:
    from dataclasses import asdict
    return {"schema": SCHEMA, "machine": machine_info(), "config": asdict(cfg),
            "seconds": seconds, "results": results,
            "goals": compute_goals(results, cfg.bucket_size), "notes": notes}


def validate(doc: dict) -> None:
    """Raise ``ValueError`` if ``doc`` does not follow the schema (used by the tests)."""
    for key in ("schema", "machine", "config", "results", "goals", "notes"):
        if key not in doc:
            raise ValueError(f"missing key {key!r}")
    if doc["schema"] != SCHEMA:
        raise ValueError(f"schema {doc['schema']!r} != {SCHEMA!r}")
    for r in doc["results"]:
        missing = [k for k in RESULT_KEYS if k not in r]
        if missing:
            raise ValueError(f"result {r.get('method')} lacks {missing}")
        if r["status"] == "ok" and not (isinstance(r["warm_median_s"], float)
                                        and r["warm_median_s"] > 0):
            raise ValueError(f"result {r['method']} has no time")


def _fmt(v: Optional[float], spec: str) -> str:
    if v is None:
        width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
        return "-".rjust(int(width or 1))
    return format(v, spec)


def format_table(doc: dict) -> str:
    lines = []
    header = (f"{'method':<18} {'kind':<10} {'cold s':>8} {'warm s':>8} {'GB/s':>6} "
              f"{'x memcpy':>8} {'+RSS MiB':>9}  note")
    for w, d, r in _cases(doc["results"]):
        rows = [x for x in doc["results"] if (x["workload"], x["dtype"], x["receivers"]) == (w, d, r)]
        size = rows[0]["bytes"] / 2**30
        lines += ["", f"== {w} ({size:.2f} GiB) {d}, {r} receiver(s) ==", header]
        mc = _find(doc["results"], "memcpy", w, d, r)
        for x in rows:
            rel = x["gbps"] / mc["gbps"] if mc and x["gbps"] else None
            extra = x["max_extra_rss_bytes"]
            note = x["note"] if x["status"] == "ok" else f"{x['status']}: {x['note']}"
            if x["status"] == "ok" and not x["ok"]:
                note = "WRONG BYTES " + note
            note = _per_tensor(x) + note
            lines.append(f"{x['method']:<18} {x['kind']:<10} {_fmt(x['cold_s'], '8.3f')} "
                         f"{_fmt(x['warm_median_s'], '8.3f')} {_fmt(x['gbps'], '6.2f')} "
                         f"{_fmt(rel, '8.2f')} {_fmt(None if extra is None else extra / 2**20, '9.0f')}"
                         f"  {note}")
    return "\n".join(lines).lstrip("\n")


def _per_tensor(x: dict) -> str:
    """``"12.3 us/tensor; "`` for a tiny workload's row, else nothing."""
    n = tensors_of(x["workload"])
    if not n or x["status"] != "ok" or not x["warm_median_s"]:
        return ""
    return f"{x['warm_median_s'] / n * 1e6:.1f} us/tensor; "


def format_goals(doc: dict) -> str:
    lines = [f"{'goal':<26} {'case':<44} {'ratio':>7} {'target':>8}  met"]
    for g in doc["goals"]:
        sign = ">=" if g["higher_is_better"] else "<="
        met = {True: "yes", False: "NO", None: "-"}[g["met"]]
        lines.append(f"{g['goal']:<26} {g['case']:<44} {_fmt(g['ratio'], '7.2f')} "
                     f"{sign}{g['target']:>6g}  {met}  {g['detail']}".rstrip())
    return "\n".join(lines)


def format_markdown(doc: dict) -> str:
    """The results and goals as Markdown tables."""
    out = []
    for w, d, r in _cases(doc["results"]):
        rows = [x for x in doc["results"] if (x["workload"], x["dtype"], x["receivers"]) == (w, d, r)]
        out += ["", f"**{w}** ({rows[0]['bytes'] / 2**30:.2f} GiB, {d}), {r} receiver(s)", "",
                "| method | kind | cold s | warm s (median) | GB/s | x memcpy | max extra RSS MiB |",
                "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        mc = _find(doc["results"], "memcpy", w, d, r)
        for x in rows:
            if x["status"] != "ok":
                out.append(f"| {x['method']} | {x['kind']} | {x['status']}: {x['note'][:80]} "
                           "| | | | |")
                continue
            rel = x["gbps"] / mc["gbps"] if mc and x["gbps"] else None
            extra = x["max_extra_rss_bytes"] / 2**20
            out.append(f"| {x['method']} | {x['kind']} | {_fmt(x['cold_s'], '.3f')} | "
                       f"{_fmt(x['warm_median_s'], '.3f')} | {_fmt(x['gbps'], '.2f')} | "
                       f"{_fmt(rel, '.2f')} | {extra:.0f} |")
    out += ["", "| goal | case | ratio | target | met | how |", "| --- | --- | ---: | --- | --- | --- |"]
    for g in doc["goals"]:
        sign = ">=" if g["higher_is_better"] else "<="
        met = {True: "yes", False: "**no**", None: "-"}[g["met"]]
        out.append(f"| {g['goal']} | {g['case']} | {_fmt(g['ratio'], '.2f')} | "
                   f"{sign} {g['target']:g} | {met} | {g['detail']} |")
    return "\n".join(out).lstrip("\n")


def plot(doc: dict, path: str) -> None:
    """GB/s by method and workload size; limits dashed. Needs matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in doc["results"] if r["status"] == "ok" and r["workload"].startswith("synthetic")]
    dtypes = sorted({r["dtype"] for r in ok}) or ["-"]
    recvs = sorted({r["receivers"] for r in ok}) or [1]
    fig, axes = plt.subplots(len(dtypes), len(recvs), squeeze=False,
                             figsize=(4.5 * len(recvs), 3.6 * len(dtypes)))
    for i, d in enumerate(dtypes):
        for j, r in enumerate(recvs):
            ax = axes[i][j]
            rows = [x for x in ok if x["dtype"] == d and x["receivers"] == r]
            for m in sorted({x["method"] for x in rows}):
                pts = sorted((x["bytes"] / 2**30, x["gbps"]) for x in rows if x["method"] == m)
                kind = next(x["kind"] for x in rows if x["method"] == m)
                style = {"limit": "--", "baseline": ":", "weightsync": "-"}[kind]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=m)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{d}, {r} receiver(s)")
            ax.set_xlabel("weights (GiB)")
            ax.set_ylabel("GB/s (warm median)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
