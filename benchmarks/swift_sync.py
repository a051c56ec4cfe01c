"""Per-sync time through ms-swift's own ``CheckpointEngineManager`` vs weightsync's own
manager: same Ray actors, same model, same backend, in one run.

The cluster is ``SwiftCluster`` of ``tests/harness_swift.py`` (2 FSDP2 trainer
ranks, 2 HF rollout replicas standing in for ms-swift's ``MegatronWorker`` /
``VllmServer``). For each weight-set kind (``full``: merged weights every sync;
``adapter``: LoRA, the base once, then adapter-only syncs) and each backend, both managers
take turns of ``--block`` syncs (default 1: they alternate sync by sync, so load drift on
a shared box hits both alike) until each has run ``--syncs`` timed syncs; with
``--block`` > 1 the first sync of every turn is run but not timed. Both managers keep their
engines and groups all along (two engines per actor); two warm-up syncs each come first.
Reported: the median and min per manager and the ratio ms-swift / weightsync.
``--phases`` adds the mean time of each driver-side call of a sync (weightsync: per phase
of ``call_all``; ms-swift: per ``ray.get`` of its manager, in order).

    .venv/bin/python benchmarks/swift_sync.py --backends shm,collective --kinds full,adapter
    .venv/bin/python benchmarks/swift_sync.py --backends shm --kinds adapter --block 10
    .venv/bin/python benchmarks/swift_sync.py --backends shm --kinds adapter --phases
    .venv/bin/python benchmarks/swift_sync.py --kinds full --senders all,master
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import statistics
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))      # harness_swift


class PhaseClock:
    """Driver-side time per call: weightsync's ``call_all`` by phase, ms-swift's
    ``ray.get`` by position within a sync."""

    def __init__(self) -> None:
        self.times: dict[str, list] = collections.defaultdict(list)
        self._n, self.enabled = 0, False
        self._undo: list = []

    def start_sync(self, enabled: bool = True) -> None:
        self._n, self.enabled = 0, enabled

    def install(self) -> None:
        import ray
        from weightsync.orchestration import atomic, calls, checks, group, manager
        import swift.ray.megatron.checkpoint_engine.manager as swift_manager

        real_call_all, clock = calls.call_all, self

        def timed_call_all(call_list: list, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real_call_all(call_list, *args, **kwargs)
            finally:
                method = call_list[0].method if call_list else "-"
                if clock.enabled:
                    clock.times[f"ws {kwargs.get('phase', '?')} ({method})"].append(
                        time.perf_counter() - t0)

        for mod in (atomic, checks, group, manager):
            self._undo.append((mod, "call_all", mod.call_all))
            mod.call_all = timed_call_all

        class TimedRay:
            def __getattr__(self, name: str) -> Any:
                return getattr(ray, name)

            def get(self, refs: Any, *args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return ray.get(refs, *args, **kwargs)
                finally:
                    clock._n += 1
                    if clock.enabled:
                        clock.times[f"ms-swift ray.get #{clock._n}"].append(
                            time.perf_counter() - t0)

        self._undo.append((swift_manager, "ray", swift_manager.ray))
        swift_manager.ray = TimedRay()

    def uninstall(self) -> None:
        for mod, name, value in reversed(self._undo):
            setattr(mod, name, value)
        self._undo.clear()

    def table(self, syncs: int) -> list[str]:
        out = []
        for key in sorted(self.times):
            values = self.times[key]
            out.append(f"    {key:<48} {1e3 * sum(values) / max(syncs, 1):7.2f} ms/sync "
                       f"({len(values)} calls)")
        return out


def measure(cluster: Any, backend: str, kind: str, args: argparse.Namespace,
            clock: PhaseClock, senders: str = "master") -> dict:
    from weightsync.orchestration.manager import CheckpointEngineManager as WsManager
    from weightsync.testing.toymodel import lora_config

    bucket = args.bucket_mb << 20
    cluster.build(lora_config(r=args.rank) if kind == "adapter" else None)
    cluster.use_backend(backend, bucket_size=bucket, senders=senders)
    merge = kind == "full"
    swift_mgr = cluster.manager()
    ws_mgr = WsManager(backend, cluster.trainers, cluster.rollouts, bucket_size=bucket,
                       timeout=cluster.timeout)
    runs: dict[str, Callable[[int], Any]] = {
        "ms-swift": lambda v: swift_mgr.sync_weights(merge_and_sync=merge),
        "weightsync": lambda v: ws_mgr.update_weights(v, merge_and_sync=merge)}
    times: dict[str, list] = {name: [] for name in runs}
    version = 0
    try:
        for name, run in runs.items():        # warm-up: groups, buffers, the base weights
            for _ in range(2):
                version += 1
                run(version)
        clock.times.clear()
        skip = 1 if args.block > 1 else 0
        while len(times["weightsync"]) < args.syncs:
            for name, run in runs.items():
                for i in range(args.block + skip):
                    version += 1
                    clock.start_sync(enabled=i >= skip)
                    start = time.perf_counter()
                    run(version)
                    took = time.perf_counter() - start
                    if i >= skip:         # a turn's first sync may pay for the switch
                        times[name].append(took)
        clock.start_sync(enabled=False)
    finally:
        ws_mgr.shutdown()
    med = {n: statistics.median(v) for n, v in times.items()}
    result = {"backend": backend, "kind": kind, "senders": senders, "syncs": {n: len(v) for n, v in times.items()},
              "median_ms": {n: round(1e3 * m, 2) for n, m in med.items()},
              "min_ms": {n: round(1e3 * min(v), 2) for n, v in times.items()},
              "ratio_swift_over_ws": round(med["ms-swift"] / med["weightsync"], 3)}
    if args.phases:
        result["phases"] = clock.table(len(times["weightsync"]))
        clock.times.clear()
    return result


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="shm,collective")
    parser.add_argument("--kinds", default="full,adapter", help="full, adapter (LoRA)")
    parser.add_argument("--syncs", type=int, default=30, help="timed syncs per manager")
    parser.add_argument("--block", type=int, default=1, help="syncs per turn")
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8, help="LoRA r for --kinds adapter")
    parser.add_argument("--phases", action="store_true",
                        help="also time each driver-side call of a sync")
    parser.add_argument("--senders", default="master",
                        help="ms-swift path: all (every trainer rank sends), master (rank 0 "
                             "alone, ms-swift's topology), or both: all,master")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    from harness_swift import SwiftCluster
    from weightsync.testing.toymodel import tiny_qwen2_config

    command = "python benchmarks/swift_sync.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    backends = [b for b in args.backends.split(",") if b]
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in ("full", "adapter")]
    if bad:
        parser.error(f"unknown kind(s) {bad}; known: full, adapter")
    load0 = os.getloadavg()[0]
    cluster = SwiftCluster(backends[0], bucket_size=args.bucket_mb << 20,
                           config=tiny_qwen2_config(hidden_size=args.hidden, layers=args.layers))
    clock = PhaseClock()
    if args.phases:
        clock.install()
    results = []
    try:
        for kind, backend, senders in [(k, b, s) for k in kinds for b in backends
                                       for s in args.senders.split(",") if s]:
                r = measure(cluster, backend, kind, args, clock, senders)
                results.append(r)
                m = r["median_ms"]
                print(f"{backend:<10} {kind:<8} {senders:<6} ms-swift {m['ms-swift']:7.2f} ms  weightsync "
                      f"{m['weightsync']:7.2f} ms  (medians of {r['syncs']['ms-swift']}; min "
                      f"{r['min_ms']['ms-swift']:.2f} / {r['min_ms']['weightsync']:.2f}; "
                      f"ms-swift/weightsync {r['ratio_swift_over_ws']:.3f})", flush=True)
                for line in r.get("phases", []):
                    print(line)
    finally:
        clock.uninstall()
        cluster.shutdown()
    print(f"command: {command}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (start {load0:.2f}), "
          f"{os.cpu_count()} CPUs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "results": results, "load": [load0, os.getloadavg()[0]]},
                  f, indent=1)


if __name__ == "__main__":
    main()
