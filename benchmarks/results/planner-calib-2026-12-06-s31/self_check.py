"""Each ring code's H100 timeline predicts its own syncs: the host costs read off one
``--timeline`` run (``benchmarks/timeline_costs.py``), with that run's flat D2D copy as the
device's rate, predict each event-ordered sync that run timed (the ``ring`` strategy,
colocated, as ``weightsync plan --calibrate`` prices the timed runs). Before session 31 the
reading left out the trainer's loop from a publish to its next slot wait.

    .venv/bin/python benchmarks/results/planner-calib-2026-12-06-s31/self_check.py
"""

import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import timeline_costs as tc  # noqa: E402
from gpu_bench import model_shapes  # noqa: E402
from weightsync.tools.planner.links import load_links  # noqa: E402
from weightsync.tools.planner.model import model_from_tensors  # noqa: E402
from weightsync.tools.planner.predict import predict  # noqa: E402
from weightsync.tools.planner.scenario import Scenario  # noqa: E402

RUNS = ["gpu-h100-2026-12-06-s29c/now", "gpu-h100-2026-12-06-s30/tl/c1129",
        "gpu-h100-2026-12-06-s30/tl/c1201", "gpu-h100-2026-12-06-s30/tl/now",
        "gpu-h100-2026-12-06-s31/tl/c1129", "gpu-h100-2026-12-06-s31/tl/c1201",
        "gpu-h100-2026-12-06-s31/tl/now"]


def main() -> None:
    res = os.path.join(ROOT, "benchmarks", "results")
    print(f"{'timeline':<36} {'MiB':>5} {'buckets':>7} {'sync ms':>8} {'predicted':>9} {'error':>6}")
    for run in RUNS:
        d = os.path.join(res, run)
        costs = tc.host_costs([d])
        with open(os.path.join(d, "gpu_bench.json")) as f:
            doc = json.load(f)
        model = model_from_tensors("llama3-8b-shapes", model_shapes(doc["layers"]))
        rate = doc["d2d"]["bytes"] / (doc["d2d"]["flat_ms"] / 1e3) / 1e9
        links = load_links("h100-8gpu-400g", {"links.device_mem.GBps": rate, **costs})
        for s in tc.syncs(os.path.join(d, "gpu_bench.txt")):
            if s.cfg.get("sync") != "event" or s.cfg.get("zero_copy") or s.cfg.get("push"):
                continue
            sc = Scenario(model=model, links=links, trainer_gpus=1, replicas=1,
                          placement="colocated", bucket_size=s.cfg["bucket_size"],
                          strategies=("ring",), ring_sync="event")
            ms = predict(sc).results["ring"].seconds * 1e3
            print(f"{run:<36} {s.cfg['bucket_size'] >> 20:5d} {s.publishes:7d} {s.sync_ms:8.2f} "
                  f"{ms:9.2f} {ms / s.sync_ms - 1:+6.0%}")
        print(f"{'':<36} costs: {costs}")


if __name__ == "__main__":
    main()
