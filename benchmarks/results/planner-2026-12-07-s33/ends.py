"""Session 33: what each ring --timeline run's event-ordered syncs took outside the trainer's
loop beyond one bucket's pack and unpack at the run's flat copy rate (ms, by bucket size):
the sync's end that `software.finish_us` prices. Run from the repository root:
    .venv/bin/python benchmarks/results/planner-2026-12-07-s33/ends.py
"""
import glob
import json
import os
import shutil
import tempfile

from weightsync.tools.planner import calibrate as c

tool = c._script("timeline_costs")
R = c.results_dir()
# H200 run 7 keeps its files under run-suffixed names: copy them where the reader looks
r7 = tempfile.mkdtemp()
for ext in ("txt", "json"):
    shutil.copy(f"{R}/gpu-h200-2026-12-04-programs/gpu_bench_run7.{ext}", f"{r7}/gpu_bench.{ext}")
dirs = (sorted(glob.glob(R + "/gpu-h100-2026-12-06-s*/tl/*"))
        + [R + "/gpu-h100-2026-12-06-s29c/now", R + "/gpu-h100-2026-12-06-s29c/c1129"]
        + sorted(glob.glob(R + "/gpu-h100-2026-12-06-s26/call*/c*/timeline")) + [r7])
for d in dirs:
    doc = json.load(open(os.path.join(d, "gpu_bench.json")))
    rate = doc["d2d"]["bytes"] / doc["d2d"]["flat_ms"]          # bytes per ms
    ring = [s for s in tool.syncs(os.path.join(d, "gpu_bench.txt")) if tool._plain_ring(s.cfg)]
    event = tool.median_syncs([s for s in ring if s.cfg["sync"] == "event"])
    out = [f"{b >> 20} MiB: {s.sync_ms - s.host_ms - s.wait_ms - 2 * b / rate:.2f}"
           for b, s in sorted(event.items())]
    print("H200 run 7" if d == r7 else d.split("results/")[-1], " | ".join(out))
