"""Where a traced sync's GPU time goes: reads the Chrome traces ``gpu_bench.py
--cuda-trace`` writes (one per process) and prints, per process, the GPU work (copies and
kernels) as busy intervals: when it starts and ends, how much of that span the GPU was
busy, the largest gaps, and the copy rate of the big copies.

Usage: ``python benchmarks/trace_gaps.py DIR/trace3_trainer.json DIR/trace3_rollout.json``
"""

from __future__ import annotations

import json
import sys

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path: str) -> list[dict]:
    """Every event of one trace (each file is read once)."""
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def gpu_events(evs: list[dict]) -> list[dict]:
    return sorted((e for e in evs if e.get("cat") in GPU_CATS and "dur" in e),
                  key=lambda e: e["ts"])


def busy(events: list[dict]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for e in events:
        a, b = e["ts"], e["ts"] + e["dur"]
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def report(path: str, evs: list[dict], t0: float) -> None:
    """``evs``: the trace's GPU events."""
    if not evs:
        print(f"{path}: no GPU events")
        return
    iv = busy(evs)
    start, end = iv[0][0], iv[-1][1]
    total = sum(b - a for a, b in iv)
    gaps = sorted(((iv[i + 1][0] - iv[i][1], iv[i][1] - t0) for i in range(len(iv) - 1)),
                  reverse=True)
    big = [e for e in evs if e.get("cat") == "gpu_memcpy" and
           e.get("args", {}).get("bytes", 0) >= 64 << 20]
    rate = (sum(e["args"]["bytes"] for e in big) / sum(e["dur"] for e in big) / 1e3) \
        if big else 0.0
    print(f"{path}: {len(evs)} GPU events, from {(start - t0) / 1e3:.2f} to "
          f"{(end - t0) / 1e3:.2f} ms (span {(end - start) / 1e3:.2f} ms), busy "
          f"{total / 1e3:.2f} ms ({100 * total / (end - start):.0f} %); copies >= 64 MiB "
          f"{rate:.0f} GB/s (one direction)")
    print("  largest gaps (ms, at ms):", ", ".join(f"{g / 1e3:.3f}@{at / 1e3:.2f}"
                                                  for g, at in gaps[:8]))
    names: dict[str, list[float]] = {}
    for e in evs:
        names.setdefault(e.get("name", "?")[:60], []).append(e["dur"])
    for n, d in sorted(names.items(), key=lambda kv: -sum(kv[1]))[:6]:
        print(f"  {sum(d) / 1e3:8.2f} ms  x{len(d):4d}  {n}")


def sync_window(traces: dict[str, list[dict]]) -> None:
    """With ``--timeline`` too, the engine's steps are marked in the traces (``ws_*``): the
    sync from the trainer's ``send_weights`` to its return, against the receiver's GPU
    copies (device-to-device) in it."""
    marks, copies = [], []
    for p, evs in traces.items():
        role = "T" if "trainer" in p else "R"
        marks += [(e["ts"], e["ts"] + e.get("dur", 0), role + " " + e["name"][3:])
                  for e in evs if str(e.get("name", "")).startswith("ws_")]
        if role == "R":
            copies += [(e["ts"], e["ts"] + e["dur"]) for e in evs if is_copy(e) and "dur" in e]
    send = [m for m in marks if m[2] == "T send_weights"]
    if not send or not copies:
        return
    a, b = send[-1][0], send[-1][1]
    inside = sorted(c for c in copies if a <= c[0] <= b)
    if not inside:
        return
    busy = sum(y - x for x, y in inside)
    print(f"sync {(b - a) / 1e3:.2f} ms: receiver copies from {(inside[0][0] - a) / 1e3:.2f} "
          f"to {(inside[-1][1] - a) / 1e3:.2f} ms (busy {busy / 1e3:.2f} ms, "
          f"{len(inside)} copies); the trainer returns {(b - inside[-1][1]) / 1e3:.2f} ms "
          "after the last copy")
    for x, y, n in sorted(m for m in marks if a <= m[0] <= b):
        print(f"  {(x - a) / 1e3:8.3f} .. {(y - a) / 1e3:8.3f} ms  {n}")


def is_copy(e: dict) -> bool:
    """A device-to-device copy: a memcpy, or the copy kernel a CUDA graph's memcpy node
    runs as (``memcpy128``, ``memcpy32_post``)."""
    name = e.get("name", "")
    return (e.get("cat") == "gpu_memcpy" and "DtoD" in name) or \
        (e.get("cat") == "kernel" and name.startswith("memcpy"))


def copies_window(path: str, evs: list[dict]) -> None:
    """The process's device-to-device copies (``evs``: its GPU events): from the first to
    the last, how much of that window they kept the GPU busy, and the gaps between them."""
    cp = [e for e in evs if is_copy(e)]
    if not cp:
        return
    a, b = cp[0]["ts"], cp[-1]["ts"] + cp[-1]["dur"]
    gaps = sorted(((y["ts"] - x["ts"] - x["dur"], x["ts"] + x["dur"] - a)
                   for x, y in zip(cp, cp[1:])), reverse=True)
    print(f"{path}: {len(cp)} copies in {(b - a) / 1e3:.2f} ms, busy "
          f"{sum(e['dur'] for e in cp) / 1e3:.2f} ms; largest gaps (ms, at ms): "
          + ", ".join(f"{g / 1e3:.3f}@{at / 1e3:.2f}" for g, at in gaps[:5] if g > 20))


def main() -> None:
    traces = {p: load(p) for p in sys.argv[1:]}
    gpu = {p: gpu_events(evs) for p, evs in traces.items()}
    if not any(gpu.values()):
        print("no GPU events in", ", ".join(traces))
        return
    t0 = min(e[0]["ts"] for e in gpu.values() if e)   # one clock when both traces use it
    for p, evs in gpu.items():
        report(p, evs, t0)
    for p, evs in gpu.items():
        copies_window(p, evs)
    sync_window(traces)


if __name__ == "__main__":
    main()
