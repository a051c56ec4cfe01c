"""nixl backend, two processes, VRAM -> VRAM, against a raw NIXL READ of one flat
registered region of the same bytes and one copy (device to device, or GPU to GPU with
``--devices 0,1``), in the same run.

    python benchmarks/nixl_gpu.py --gib 1 --warm 5 --out DIR [--devices 0,1]

Prints one JSON line and writes DIR/nixl_gpu.json. Also checks the bytes. ``--devices
T,R``: the trainer on GPU T, the receiver on GPU R (default 0,0). On one GPU UCX cannot
use cuda_ipc between two processes on the same device (NOTES.md), so that measures what
NIXL does there, not NVLink; two GPUs show NIXL's GPU-to-GPU path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from weightsync import CheckpointEngineRegistry  # noqa: E402
from weightsync.transport.base import worker_kwargs  # noqa: E402

MiB = 1 << 20


def tensors(nbytes: int, seed: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    out, left, i = {}, nbytes, 0
    while left > 0:
        n = min(left, 64 * MiB) // 2
        out[f"w{i}"] = torch.randn(n, generator=g, device=device).to(torch.bfloat16)
        left -= 2 * n
        i += 1
    return out


def role_main(role: str, nbytes: int, warm: int, conn, dev: int = 0) -> None:
    torch.cuda.set_device(dev)
    cls = CheckpointEngineRegistry.get("nixl")
    eng = cls(role=role, device="cuda", bucket_size=256 * MiB, timeout=120)
    conn.send(eng.prepare())
    eng.init_process_group(**conn.recv())
    params = tensors(nbytes, 0, "cuda")
    times = []
    for step in range(1 + warm):
        torch.cuda.synchronize()
        conn.send("ready")
        conn.recv()
        t0 = time.perf_counter()
        if role == "trainer":
            asyncio.run(eng.send_weights(iter(params.items()), step))
        else:
            async def go():
                async for _ in eng.receive_into(params, step):
                    pass
            asyncio.run(go())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    ok = None
    if role == "rollout":
        want = tensors(nbytes, 0, "cuda")
        ok = all(torch.equal(params[k], want[k]) for k in want)
    conn.send({"times": times, "ok": ok})
    eng.finalize()


def raw_main(role: str, nbytes: int, warm: int, conn, dev: int = 0) -> None:
    torch.cuda.set_device(dev)
    from weightsync.transport.backends.nixl.agent import NixlAgent, wait_all
    agent = NixlAgent(f"raw-{role}")
    buf = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    agent.register(buf)
    conn.send((agent.name, agent.metadata(), buf.data_ptr(), dev))
    name, meta, addr, peer_dev = conn.recv()
    times = []
    if role == "rollout":
        agent.add_remote(name, meta, peer="trainer")
        reads = agent.reads(name, [(buf.data_ptr(), nbytes)], [(addr, nbytes)], mem="VRAM",
                            remote_mem="VRAM", device=dev, remote_device=peer_dev,
                            peer="trainer")
        for step in range(1 + warm):
            t0 = time.perf_counter()
            reads.post(version=step)
            wait_all([reads], time.monotonic() + 120, version=step)
            times.append(time.perf_counter() - t0)
        reads.release()
    conn.send({"times": times})
    conn.recv()
    agent.close()


def run_pair(target, nbytes: int, warm: int, topo: bool, devs=(0, 0)) -> list:
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for role, dev in zip(("trainer", "rollout"), devs):
        a, b = ctx.Pipe()
        procs.append(ctx.Process(target=target, args=(role, nbytes, warm, b, dev)))
        pipes.append(a)
    for p in procs:
        p.start()
    first = [c.recv() for c in pipes]
    if topo:
        tk, rk = CheckpointEngineRegistry.get("nixl").build_topology(1, 1, first)
        pipes[0].send(worker_kwargs(tk, 0))
        pipes[1].send(worker_kwargs(rk, 0))
        for _ in range(1 + warm):
            for c in pipes:
                assert c.recv() == "ready"
            for c in pipes:
                c.send("go")
    else:
        pipes[0].send(first[1])
        pipes[1].send(first[0])
    out = [c.recv() for c in pipes]
    if not topo:
        for c in pipes:
            c.send("bye")
    for p in procs:
        p.join(60)
    return out


def device_copy(nbytes: int, warm: int, devs=(0, 0)) -> list:
    a = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{devs[0]}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{devs[1]}")
    times = []
    for _ in range(1 + warm):
        for d in set(devs):
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        b.copy_(a)
        for d in set(devs):
            torch.cuda.synchronize(d)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--out", default=".")
    ap.add_argument("--devices", default="0,0", help="trainer GPU, receiver GPU")
    args = ap.parse_args()
    devs = tuple(int(x) for x in args.devices.split(","))
    nbytes = int(args.gib * (1 << 30))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    res = {"bytes": nbytes, "ucx_tls": os.environ.get("UCX_TLS", "auto"), "devices": devs}
    copy = device_copy(nbytes, args.warm, devs)
    res["device_copy_s"] = med(copy[1:])
    raw = run_pair(raw_main, nbytes, args.warm, topo=False, devs=devs)[1]["times"]
    res["raw_read_cold_s"], res["raw_read_warm_s"] = raw[0], med(raw[1:])
    tr, rx = run_pair(role_main, nbytes, args.warm, topo=True, devs=devs)
    res["nixl_cold_s"], res["nixl_warm_s"] = rx["times"][0], med(rx["times"][1:])
    res["trainer_warm_s"], res["bytes_ok"] = med(tr["times"][1:]), rx["ok"]
    res["nixl_vs_raw"] = res["raw_read_warm_s"] / res["nixl_warm_s"]
    res["nixl_vs_copy"] = res["device_copy_s"] / res["nixl_warm_s"]
    print(json.dumps(res))
    with open(os.path.join(args.out, "nixl_gpu.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
