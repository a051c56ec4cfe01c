"""Late joiner over ``nixl``: how long it takes to bring a replica added mid-training to
the current version, and what the serving replicas do meanwhile.

Workers in this process (no Ray; ``WEIGHTSYNC_NIXL_SERVE=staging`` unless set), the demo's model shapes (Qwen2-like, hidden 256, 4
layers, vocabulary 4096, float32: ~20 MB). One trainer, ``--replicas`` HF replicas
serving; a thread generates on them without pause. Then, ``--rounds`` times each:

* ``join``: ``add_replica(new)`` (it pulls the current version from the trainer's arena;
  nothing is called on the others) — time until it is routed to;
* ``join-replica``: ``add_replica(new, join_from="replica")``: it reads the version from
  a healthy replica's landed memory; the trainer is not asked;
* ``join-busy``: ``add_replica(new, join_wait_s=--wait)`` while the trainer is in a
  training step and answers nothing (``BusyTrainer`` of ``tests/busytrainer.py``, as a
  Ray actor in a step): ``auto`` waits ``--wait`` seconds for the trainer, then reads
  from a healthy replica;
* ``next-sync``: ``add_replica(new, join=False)`` then ``update_weights`` — the way a
  replica joins without the join path: one sync that pauses every replica.

Prints one JSON line per round and a summary: seconds to bring the new replica to the
current version, generations completed on the serving replicas during it, how many were
aborted (a sync aborts running generations), and versions they carried.

    .venv/bin/python benchmarks/late_joiner.py --replicas 2 --rounds 3
    .venv/bin/python benchmarks/late_joiner.py --modes join,join-replica,join-busy,next-sync
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

from weightsync.integrations.ray.workers import HFRolloutWorker, ToyTrainerWorker
from weightsync.orchestration.manager import CheckpointEngineManager
from weightsync.testing.toymodel import random_prompts, tiny_qwen2_config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from busytrainer import BusyTrainer  # noqa: E402  (tests/busytrainer.py)


def _serve(replicas: list, prompts: list, stop: threading.Event, log: list) -> None:
    i = 0
    while not stop.is_set():
        r = replicas[i % len(replicas)]
        i += 1
        try:
            for g in r.generate(prompts, max_new_tokens=16):
                log.append((time.monotonic(), g.aborted, g.version))
        except Exception as exc:  # fenced during a sync: counted as a refusal
            log.append((time.monotonic(), True, f"refused: {type(exc).__name__}"))
            time.sleep(0.01)


def main() -> None:
    # ``join`` reads from the trainer's arena, which holds the last version while the
    # trainer trains on only when every tensor is staged (with the default ``auto`` the
    # trainer serves its live parameters and offers no join)
    os.environ.setdefault("WEIGHTSYNC_NIXL_SERVE", "staging")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="join,next-sync",
                    help="comma list of join, join-replica, join-busy, next-sync")
    ap.add_argument("--wait", type=float, default=0.5,
                    help="join-busy: join_wait_s, how long auto waits for the trainer")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = sorted(set(modes) - {"join", "join-replica", "join-busy", "next-sync"})
    if bad:
        ap.error(f"unknown modes {bad}")
    cfg = tiny_qwen2_config(vocab_size=4096, hidden_size=256, layers=4,
                            intermediate_size=256 * 11 // 4 // 8 * 8)
    prompts = random_prompts(2, 12, vocab_size=4096)
    trainer = BusyTrainer(ToyTrainerWorker())
    trainer.build(cfg, lr=0.05)
    serving = [HFRolloutWorker(cfg, seed=5 + i) for i in range(args.replicas)]
    rows = []
    with CheckpointEngineManager("nixl", [trainer], serving, bucket_size=4 << 20,
                                 timeout=60) as manager:
        step = 0
        for mode in modes * args.rounds:
            step += 1
            trainer.train_step(step)
            manager.update_weights(step)
            for r in list(manager.replicas)[args.replicas:]:
                manager.remove_replica(r)
            step += 1
            trainer.train_step(step)       # the trainer moves on; v(step-1) is current
            newcomer = HFRolloutWorker(cfg, seed=100 + step)
            log: list = []
            stop = threading.Event()
            t = threading.Thread(target=_serve, args=(serving, prompts, stop, log))
            t.start()
            time.sleep(0.5)
            t0 = time.monotonic()
            if mode == "join":
                manager.add_replica(newcomer, join_from="trainer")
                held = newcomer.rollout.current_version()
            elif mode == "join-replica":
                manager.add_replica(newcomer, join_from="replica")
                held = newcomer.rollout.current_version()
            elif mode == "join-busy":
                with trainer.training(step + 1000):   # a step nobody syncs: it is busy
                    t0 = time.monotonic()
                    manager.add_replica(newcomer, join_wait_s=args.wait)
                    held = newcomer.rollout.current_version()
                    t1 = time.monotonic()
            else:
                manager.add_replica(newcomer, join=False)
                manager.update_weights(step)
                held = newcomer.rollout.current_version()
            if mode != "join-busy":
                t1 = time.monotonic()
            time.sleep(0.2)
            stop.set()
            t.join(60)
            during = [e for e in log if t0 <= e[0] <= t1]
            row = {"mode": mode, "seconds": round(t1 - t0, 4), "version_held": held,
                   "routed": newcomer in manager.healthy_replicas(),
                   "gens_during": len(during),
                   "aborted_or_refused_during": sum(1 for e in during if e[1]),
                   "versions_during": sorted({str(e[2]) for e in during})}
            if mode.startswith("join"):
                row["join"] = {k: v for k, v in (manager.last_join or {}).items()
                               if k in ("bytes", "seconds", "transport_seconds", "source")}
            print(json.dumps(row), flush=True)
            rows.append(row)
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        print(json.dumps({"summary": mode,
                          "median_s": statistics.median(r["seconds"] for r in mine),
                          "gens_during": [r["gens_during"] for r in mine],
                          "aborted_or_refused": [r["aborted_or_refused_during"] for r in mine]}))


if __name__ == "__main__":
    main()
