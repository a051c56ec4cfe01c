"""How a prediction is shown: a text table, the JSON document, a PNG plot.

Owns :func:`format_table`, :func:`write_json` and :func:`plot` (matplotlib, imported
only when a plot is asked for). Everything shown comes from
:meth:`~.predict.Prediction.to_dict`, so the table, the JSON and the plot agree.
"""

from __future__ import annotations

import json

__all__ = ["format_table", "write_json", "plot"]


def _gb(x: float) -> str:
    return f"{x / 1e9:.4g}"


def _header(d: dict) -> list[str]:
    s, b = d["scenario"], d["bound"]
    fp8 = f" (block 128, quantized on the {s['fp8_at']})" if s["dst_dtype"] == "fp8" else ""
    ro = s["rollout"]
    ep = f" x EP {ro['ep']}" if ro["ep"] else ""
    tr = s["trainer"]
    on = " on their GPUs" if tr.get("device") == "gpu" else ""
    shared = f"; in shared memory: {s['shared']}" if s.get("shared", "none") != "none" else ""
    return [
        f"weightsync plan{': ' + s['label'] if s['label'] else ''}",
        f"  model: {s['model']} ({s['params'] / 1e9:.4g} B params, {s['tensors']} tensors), "
        f"{s['src_dtype']} -> {s['dst_dtype']}{fp8}",
        f"  trainer: {tr['gpus']} ranks ({tr['layout']}){on}"
        f" on {s['links']}; rollout: {ro['replicas']} replicas x TP {ro['tp']}{ep} = "
        f"{ro['workers']} workers ({ro['placement']}) on "
        f"{s['rollout_links']}; {s['nodes']} node(s){shared}",
        f"  line-rate bound: {b['seconds']:.4g} s ({_gb(b['bytes'])} GB kept by "
        f"{b['worker']}, in over {'+'.join(b['via'])} at {b['ingress_GBps']:.4g} GB/s)",
    ]


def _strategy_rows(d: dict) -> list[str]:
    rows = [f"  {'strategy':<10}{'predicted s':>12}{'x bound':>9}  {'reads/worker':>12}"
            f"{'GB in/worker':>13}{'GB out/rank':>12}  bottleneck"]
    for name, r in d["strategies"].items():
        if not r["applicable"]:
            rows.append(f"  {name:<10}{'-':>12}{'-':>9}  n/a: {r['reason']}")
            continue
        b = r["bottleneck"]
        rows.append(f"  {name:<10}{r['seconds']:>12.4g}{r['ratio_to_bound']:>9.3g}  "
                    f"{r['reads_per_dest']['max']:>12.4g}{_gb(r['bytes_per_dest']['max']):>13}"
                    f"{_gb(r['bytes_per_source']['max']):>12}  {b['phase']}: {b['limited_by']}")
    return rows


def format_table(d: dict) -> str:
    """The human-readable report of one prediction (``Prediction.to_dict()``)."""
    out = _header(d) + [""] + _strategy_rows(d) + ["", "  phases (one after another):"]
    for name, r in d["strategies"].items():
        if r["applicable"]:
            parts = [f"{p['phase']} {p['seconds']:.4g} s ({p['limited_by']})" for p in r["phases"]]
            out.append(f"    {name:<10}" + " | ".join(parts))
    out.append("  busiest link of each kind (bytes, busy seconds):")
    for name, r in d["strategies"].items():
        if r["applicable"]:
            parts = [f"{k} {_gb(v['bytes'])} GB {v['seconds']:.3g} s"
                     for k, v in sorted(r["links"].items(), key=lambda kv: -kv[1]["seconds"])]
            out.append(f"    {name:<10}" + "; ".join(parts))
    if d["plan"]:
        p = d["plan"]
        out.append(f"  p2p plan: {p['compile_plan_calls']} compile_plan calls "
                   f"({p['compile_seconds']:.2f} s), one per distinct tensor layout")
    notes = d["notes"] + [f"{n}: {x}" for n, r in d["strategies"].items()
                          for x in r.get("notes", [])]
    out += [f"  note: {n}" for n in notes]
    out.append(f"  planned in {d['planning_seconds']:.2f} s")
    return "\n".join(out)


def write_json(d: dict, path: str) -> None:
    text = json.dumps(d, indent=1, default=float)
    if path == "-":
        print(text)
        return
    with open(path, "w") as f:
        f.write(text + "\n")


def plot(d: dict, path: str) -> None:
    """Left: predicted seconds per strategy, stacked by phase, with the bound. Right: the
    busiest link of each kind, per strategy (busy seconds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    live = {n: r for n, r in d["strategies"].items() if r["applicable"]}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, r) in enumerate(live.items()):
        bottom = 0.0
        for p in r["phases"]:
            ax.bar(i, p["seconds"], bottom=bottom, label=f"{name}: {p['phase']}")
            bottom += p["seconds"]
        ax.text(i, bottom, f"{bottom:.3g} s\n{r['ratio_to_bound']:.2f}x", ha="center",
                va="bottom", fontsize=8)
    ax.axhline(d["bound"]["seconds"], color="k", ls="--", lw=1, label="line-rate bound")
    ax.set_xticks(range(len(live)), list(live))
    ax.set_ylabel("predicted seconds")
    if any(r["seconds"] > 20 * d["bound"]["seconds"] for r in live.values()):
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    kinds = sorted({k for r in live.values() for k in r["links"]})
    width = 0.8 / max(len(live), 1)
    for i, (name, r) in enumerate(live.items()):
        xs = [j + i * width for j in range(len(kinds))]
        bx.bar(xs, [r["links"].get(k, {}).get("seconds", 0.0) for k in kinds], width,
               label=name)
    bx.set_xticks([j + width * (len(live) - 1) / 2 for j in range(len(kinds))], kinds,
                  rotation=30, fontsize=8)
    bx.set_ylabel("busiest link of the kind: busy seconds")
    bx.legend(fontsize=7)
    fig.suptitle(_title(d), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _title(d: dict) -> str:
    s = d["scenario"]
    return (f"{s['label'] or s['model']}: {s['trainer']['gpus']} trainer ranks -> "
            f"{s['rollout']['replicas']} x TP {s['rollout']['tp']}"
            f"{' x EP ' + str(s['rollout']['ep']) if s['rollout']['ep'] else ''}, "
            f"{s['src_dtype']} -> {s['dst_dtype']}")
