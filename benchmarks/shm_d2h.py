"""GPU trainer -> ``shm`` -> CPU receiver on one host, against the raw device-to-host copy.

Measures in one run, on a synthetic bf16 model of Llama-3-8B layer shapes
(``--layers``; 8 layers = 5.6 GB):
(a) one device-to-host copy of the model's bytes into pinned host memory, and into
    pageable memory (CUDA events, median of 5);
(b) ``shm`` syncs from CUDA tensors of the trainer into a CPU receiver that lands them
    with ``receive_into`` (the README's consumer, torch's default threads), warm median of
    ``--warm``; the trainer, using CUDA, registers the ring as pinned memory; every sync is
    checked (per-tensor sums);
(b') the same with the receiver's tensors in torch's shared memory (``--consumers
    shared``: ``model.share_memory()`` on the receiver), which the trainer then copies
    device-to-host straight into (no ring, no landing copy);
(c) where the time goes (``--consumers into,views``): the same syncs consumed with
    ``receive_weights`` and no copy (each tensor a view of the ring, dropped: what the
    trainer and the protocol cost alone, the receiver's landing copy left out), and the
    receiver host's own copy rate of the model's bytes (one ``copy_`` of a pageable buffer,
    torch's default threads): the limit of the landing copy.
Usage: ``python benchmarks/shm_d2h.py --out DIR [--layers 8 --bucket-mb 512 --warm 5
--consumers into,shared,views]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "src")]


def _sums(params):
    import torch
    return [int(p.view(torch.int16).to(torch.int64).sum()) for p in params.values()]


def worker(role, args, conn):
    try:
        import torch
        from gpu_bench import model_shapes
        from weightsync import CheckpointEngineRegistry
        cuda = torch.cuda.is_available()      # without: a CPU plumbing check only
        dev = "cuda" if role == "trainer" and cuda else "cpu"
        params = {n: torch.empty(s, dtype=torch.bfloat16, device=dev)
                  for n, s in model_shapes(args["layers"], args["scale"])}
        nbytes = sum(p.numel() * 2 for p in params.values())
        out = {"bytes": nbytes}
        if role == "rollout":
            src = torch.ones(nbytes, dtype=torch.uint8)
            dst = torch.empty_like(src)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                dst.copy_(src)
                times.append((time.perf_counter() - t0) * 1e3)
            out.update(host_copy_ms=statistics.median(times[1:]), threads=torch.get_num_threads())
            del src, dst
        if role == "trainer" and not cuda:
            out.update(d2h_pinned_ms=1.0, d2h_pageable_ms=1.0)
        elif role == "trainer":
            torch.cuda.init()
            flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            for kind in ("pinned", "pageable"):
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")
                times = []
                for _ in range(7):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    host.copy_(flat, non_blocking=kind == "pinned")
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b))
                out[f"d2h_{kind}_ms"] = statistics.median(times[2:])
                del host
            del flat
        conn.send(out)
        params_shared = False
        while True:
            cmd = conn.recv()
            if cmd["op"] == "quit":
                return
            if cmd["op"] == "engine":
                engine = CheckpointEngineRegistry.new(
                    "shm", role=role, device="cpu", bucket_size=args["bucket_mb"] << 20,
                    timeout=120)
                conn.send({"meta": engine.prepare()})
                engine.init_process_group(**conn.recv())
                conn.send({"pinned": len(getattr(engine, "_pinned", []))})
            elif cmd["op"] == "sync":
                step = cmd["step"]
                if role == "trainer":
                    g = torch.Generator(device=dev).manual_seed(step)
                    for p in params.values():
                        p.normal_(generator=g)
                    if cuda:
                        torch.cuda.synchronize()
                    want = _sums(params)
                    conn.send({"ready": True})
                    start = time.perf_counter()
                    report = asyncio.run(engine.send_weights(params.items(), version=step))
                    conn.send({"ms": (time.perf_counter() - start) * 1e3, "sums": want,
                               "pushed": report.get("pushed")})
                else:
                    if cmd.get("consumer") == "shared" and not params_shared:
                        for p in params.values():   # the receiver's model.share_memory()
                            p.share_memory_()
                        params_shared = True
                    conn.send({"ready": True})
                    views = cmd.get("consumer") == "views"
                    sums = {}

                    async def recv():
                        if views:       # no landing copy: each view dropped, names counted
                            async for name, t in engine.receive_weights(version=step):
                                sums[name] = None
                            return
                        async for _ in engine.receive_into(params, version=step):
                            pass
                    start = time.perf_counter()
                    asyncio.run(recv())
                    ms = (time.perf_counter() - start) * 1e3
                    conn.send({"sums": None if views else _sums(params), "ms": ms,
                               "names": len(sums) if views else len(params)})
            elif cmd["op"] == "close":
                engine.finalize()
                conn.send({})
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--scale", type=int, default=1, help="divide every dimension")
    ap.add_argument("--consumers", default="into,shared", help="into (receive_into), "
                    "shared (receive_into of tensors the receiver put in shared memory: the "
                    "trainer writes into them), views (receive_weights, no copy); "
                    "comma-separated")
    args = vars(ap.parse_args())
    os.makedirs(args["out"], exist_ok=True)
    from weightsync.transport.base import worker_kwargs
    from weightsync.transport.backends.shm.engine import ShmEngine
    ctx = mp.get_context("spawn")
    conns, procs = {}, []
    for role in ("trainer", "rollout"):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=worker, args=(role, args, child), daemon=True)
        p.start()
        conns[role], procs = parent, procs + [p]

    def get(role):
        if not conns[role].poll(600):
            raise TimeoutError(role)
        msg = conns[role].recv()
        if "error" in msg:
            raise RuntimeError(msg["error"])
        return msg
    res = {"args": args, "trainer": get("trainer"), "rollout": get("rollout"), "runs": []}
    for consumer in args["consumers"].split(","):
        for r in conns:
            conns[r].send({"op": "engine"})
        metas = [get("trainer")["meta"], get("rollout")["meta"]]
        tk, rk = ShmEngine.build_topology(1, 1, metas)
        conns["trainer"].send(worker_kwargs(tk, 0))
        conns["rollout"].send(worker_kwargs(rk, 0))
        pinned = get("trainer")["pinned"]
        get("rollout")
        ms, rx_ms, ok = [], [], True
        for step in range(args["warm"] + 1):
            conns["trainer"].send({"op": "sync", "step": step})
            get("trainer")
            conns["rollout"].send({"op": "sync", "step": step, "consumer": consumer})
            get("rollout")
            t = get("trainer")
            r = get("rollout")
            ms.append(t["ms"])
            rx_ms.append(r["ms"])
            ok = ok and (t["sums"] == r["sums"] if consumer != "views" else
                         r["names"] == len(t["sums"]))
            pushed = t.get("pushed")
        for r in conns:
            conns[r].send({"op": "close"})
            get(r)
        run = {"consumer": consumer, "pinned_segments": pinned, "cold_ms": ms[0],
               "warm_ms": ms[1:], "median_ms": statistics.median(ms[1:]),
               "receiver_median_ms": statistics.median(rx_ms[1:]), "all_ok": ok,
               "pushed_tensors": pushed}
        res["runs"].append(run)
        print(json.dumps(run), flush=True)
    for r in conns:
        conns[r].send({"op": "quit"})
    t = res["trainer"]
    gb = t["bytes"] / 1e9
    rx = res["rollout"]
    print(f"model {gb:.2f} GB bf16, bucket {args['bucket_mb']} MiB; D2H pinned "
          f"{t['d2h_pinned_ms']:.1f} ms ({gb / t['d2h_pinned_ms'] * 1e3:.1f} GB/s), pageable "
          f"{t['d2h_pageable_ms']:.1f} ms ({gb / t['d2h_pageable_ms'] * 1e3:.1f} GB/s); "
          f"receiver host copy {rx['host_copy_ms']:.1f} ms "
          f"({gb / rx['host_copy_ms'] * 1e3:.1f} GB/s, {rx['threads']} threads)")
    for run in res["runs"]:
        print(f"shm {run['consumer']} "
              f"({run['pinned_segments']} segments pinned): "
              f"warm {run['median_ms']:.1f} ms ({gb / run['median_ms'] * 1e3:.1f} GB/s) = "
              f"{t['d2h_pinned_ms'] / run['median_ms']:.2f} x the pinned D2H; checks "
              f"{'ok' if run['all_ok'] else 'MISMATCH'}")
    with open(os.path.join(args["out"], "shm_d2h.json"), "w") as f:
        json.dump(res, f, indent=1)
    for p in procs:
        p.join(30)


if __name__ == "__main__":
    main()
