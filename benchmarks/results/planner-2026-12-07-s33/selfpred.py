"""Session 33: each ring --timeline run predicted with the host costs read off that run alone
(in-sample): the planner's own error apart from the spread between machines. Prints
predicted / the run's median ms and the error per configuration (e: event, h: host-ordered).
Run from the repository root:
    .venv/bin/python benchmarks/results/planner-2026-12-07-s33/selfpred.py [DIR ...]
"""
import glob
import json
import os
import sys

from weightsync.tools.planner import calibrate as c
from weightsync.tools.planner.links import load_links
from weightsync.tools.planner.model import model_from_tensors
from weightsync.tools.planner.predict import predict
from weightsync.tools.planner.scenario import Scenario

tool = c._script("timeline_costs")
gb = c._script("gpu_bench")
R = c.results_dir()
dirs = sys.argv[1:] or (["gpu-h100-2026-12-06-s29c/now"]
                        + sorted(glob.glob(R + "/gpu-h100-2026-12-06-s3[01]/tl/*")))
for d in dirs:
    d = os.path.join(R, d)
    costs = tool.host_costs([d])
    doc = json.load(open(os.path.join(d, "gpu_bench.json")))
    model = model_from_tensors("llama3-8b-shapes", gb.model_shapes(doc["layers"]))
    sets = {**costs, "links.device_mem.GBps":
            doc["d2d"]["bytes"] / (doc["d2d"]["flat_ms"] / 1e3) / 1e9}
    sets.setdefault("software.pack_wait_x", c.OLD_PACK_WAIT_X["software.pack_wait_x"])
    out = []
    for e in doc["engine"]:
        cfg = e["cfg"]
        if not tool._plain_ring(cfg):
            continue
        sc = Scenario(model=model, links=load_links("h200-8gpu-400g", sets), trainer_gpus=1,
                      replicas=1, placement="colocated", bucket_size=cfg["bucket_size"],
                      strategies=("ring",), shared="none", ring_sync=cfg["sync"])
        p = predict(sc).results["ring"].seconds * 1e3
        out.append(f"{cfg['bucket_size'] >> 20}{cfg['sync'][0]} {p:.1f}/{e['median_ms']:.1f} "
                   f"{100 * (p / e['median_ms'] - 1):+.0f}%")
    print(d.split("results/")[-1], costs)
    print("   ", " | ".join(out))
