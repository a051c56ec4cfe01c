"""nixl across GPUs: M trainer ranks on one GPU, N rollout workers on another, each worker
keeping its tensor-parallel slice (TP N), landed with ``receive_into`` in its own shards;
beside a raw NIXL READ of the same bytes per worker and a raw NCCL broadcast, same run.

    python benchmarks/nixl_multi.py --gib 4 --trainers 2 --tp 2 --devices 0,1 --out DIR

The model has Llama-3-8B shapes (hidden 4096, 8 KV heads, FFN 14336, vocab 128256; as
many layers as ``--gib`` holds): column-parallel weights (q, k, v, gate, up, embedding)
are split on dim 0, row-parallel ones (o, down) on dim 1, norms kept whole, as vLLM
shards them. ``--trainers M``: every trainer rank holds the whole model and yields it
(``full``; the plan spreads the reads over the ranks), or with ``--shards`` yields its
FSDP2 ``Shard(0)`` DTensor shards (each byte on one rank). Time of a step: the slowest
worker, each step started together; warm = median after the first. ``--devices T,R``:
trainers on GPU T, workers on GPU R (``cpu`` runs the same on DRAM and gloo, a dry run).
Prints one JSON line per case and writes DIR/nixl_multi.json; checks every worker's
bytes after the last sync.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import traceback

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from weightsync import CheckpointEngineRegistry  # noqa: E402
from weightsync.core.xferplan import Keep  # noqa: E402
from weightsync.transport.base import worker_kwargs  # noqa: E402

LLAMA8B = (4096, 1024, 14336, 128256)       # hidden, k/v rows, FFN, vocab
SMALL = (256, 64, 896, 4096)                # --small: the same shapes, scaled down


def model_spec(nbytes: int, dims: tuple) -> list[tuple[str, tuple, int | None]]:
    """(name, shape, TP split dim or None) of a bf16 model of about ``nbytes``."""
    h, kv, ffn, vocab = dims
    layer = [("self_attn.q_proj.weight", (h, h), 0), ("self_attn.k_proj.weight", (kv, h), 0),
             ("self_attn.v_proj.weight", (kv, h), 0), ("self_attn.o_proj.weight", (h, h), 1),
             ("mlp.gate_proj.weight", (ffn, h), 0), ("mlp.up_proj.weight", (ffn, h), 0),
             ("mlp.down_proj.weight", (h, ffn), 1), ("input_layernorm.weight", (h,), None),
             ("post_attention_layernorm.weight", (h,), None)]
    per_layer = sum(math.prod(s) for _, s, _ in layer) * 2
    layers = max(1, (nbytes - vocab * h * 2) // per_layer)
    spec = [("embed_tokens.weight", (vocab, h), 0)]
    for i in range(layers):
        spec += [(f"layers.{i}.{n}", s, d) for n, s, d in layer]
    return spec + [("norm.weight", (h,), None)]


def box_of(shape: tuple, split: int | None, rank: int, tp: int) -> tuple:
    box = [(0, d) for d in shape]
    if split is not None and tp > 1:
        n = shape[split] // tp
        box[split] = (rank * n, (rank + 1) * n)
    return tuple(box)


def keep_of(spec: list, rank: int, tp: int) -> Keep:
    return Keep(boxes={n: (box_of(s, d, rank, tp),) for n, s, d in spec
                       if d is not None and tp > 1})


def full_tensor(name: str, shape: tuple, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(sum(name.encode()) * 1000 + len(name))
    return torch.randn(shape, generator=g, device=device).to(torch.bfloat16)


def kept_bytes(spec: list, rank: int, tp: int) -> int:
    return sum(math.prod(b - a for a, b in box_of(s, d, rank, tp)) * 2 for _, s, d in spec)


def shard0(full: torch.Tensor, rank: int, world: int):
    """Rank ``rank``'s FSDP2 ``Shard(0)`` DTensor of ``full`` (no process group needed)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = DeviceMesh(full.device.type, list(range(world)), _init_backend=False, _rank=rank)
    local = full.chunk(world, 0)[rank].contiguous()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape,
                              stride=full.stride())


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize(dev)


def _steps(conn, dev: str, n: int, body) -> list[float]:
    times = []
    for step in range(n):
        _sync(dev)
        conn.send("ready")
        conn.recv()
        t0 = time.perf_counter()
        body(step)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return times


def nixl_worker(role: str, rank: int, cfg: dict, conn) -> None:
    try:
        dev = cfg["devs"][0 if role == "trainer" else 1]
        if dev.startswith("cuda"):
            torch.cuda.set_device(torch.device(dev))
        spec, tp, m = cfg["spec"], cfg["tp"], cfg["trainers"]
        eng = CheckpointEngineRegistry.new("nixl", role=role, device=dev,
                                           bucket_size=256 << 20, timeout=120)
        conn.send(eng.prepare())
        eng.init_process_group(**conn.recv())
        if role == "trainer":
            items = []
            for n, s, _ in spec:
                t = full_tensor(n, s, dev)
                items.append((n, shard0(t, rank, m) if cfg["shards"] else t))

            stats = []

            def body(step):
                st = asyncio.run(eng.send_weights(items, step))
                stats.append([st["layout_sent"], st["pipelined"], round(st["stage_seconds"], 5)])
            times = _steps(conn, dev, 1 + cfg["warm"], body)
            ok = {"held_bytes": eng._arena.nbytes, "steps": stats}
        else:
            eng.keep_slices(lambda layout: keep_of(spec, rank, tp))
            params = {n: torch.empty(tuple(b - a for a, b in box_of(s, d, rank, tp)),
                                     dtype=torch.bfloat16, device=dev) for n, s, d in spec}

            boxes = {n: tuple(slice(a, b) for a, b in box_of(s, d, rank, tp))
                     for n, s, d in spec}

            async def drain(step):
                if cfg["consume"] == "into":
                    async for _ in eng.receive_into(params, step):
                        pass
                    return
                # the README's loop: each tensor in its full shape, only its kept box
                # filled (partial_boxes); the worker copies that box into its shard
                async for name, t in eng.receive_weights(step):
                    params[name].copy_(t[boxes[name]])
            times = _steps(conn, dev, 1 + cfg["warm"], lambda step: asyncio.run(drain(step)))
            plan = eng.last_plan
            ok = {"exact": all(torch.equal(params[n], full_tensor(n, s, dev)[
                      tuple(slice(a, b) for a, b in box_of(s, d, rank, tp))]) for n, s, d in spec),
                  "plan_bytes": plan.total_bytes, "reads": len(plan.reads),
                  "kept_bytes": kept_bytes(spec, rank, tp),
                  "extra_dev_bytes": int(eng._pull_plan.landing.numel())}
        conn.send({"times": times, "check": ok})
        conn.recv()
        eng.finalize()
    except BaseException:
        conn.send({"fatal": traceback.format_exc()[-3000:]})


def raw_worker(role: str, rank: int, cfg: dict, conn) -> None:
    """Raw NIXL: each worker READs its kept bytes, an equal share from every trainer rank
    (one flat registered region each, in ``cfg['pieces']`` descriptors), all workers at
    once."""
    try:
        from weightsync.transport.backends.nixl.agent import NixlAgent, wait_all
        dev = cfg["devs"][0 if role == "trainer" else 1]
        if dev.startswith("cuda"):
            torch.cuda.set_device(torch.device(dev))
        m = cfg["trainers"]
        share = -(-max(kept_bytes(cfg["spec"], r, cfg["tp"]) for r in range(cfg["tp"])) // m)
        piece = -(-share // cfg.get("pieces", 1))
        mem = "VRAM" if dev.startswith("cuda") else "DRAM"
        index = torch.device(dev).index or 0
        agent = NixlAgent(f"raw-{role}-{rank}")
        buf = torch.ones(share * (m if role == "rollout" else 1), dtype=torch.uint8, device=dev)
        agent.register(buf)
        conn.send((agent.name, agent.metadata(), buf.data_ptr(), index))
        peers = conn.recv()
        times = []
        if role == "rollout":
            reads = []
            for i, (name, meta, addr, pdev) in enumerate(peers):
                agent.add_remote(name, meta, peer=f"trainer rank {i}")
                at = range(0, share, piece)
                reads.append(agent.reads(name, [(buf.data_ptr() + i * share + o,
                                                 min(piece, share - o)) for o in at],
                                         [(addr + o, min(piece, share - o)) for o in at],
                                         mem=mem, remote_mem=mem,
                                         device=index, remote_device=pdev,
                                         peer=f"trainer rank {i}"))

            def body(step):
                for r in reads:
                    r.post(version=step)
                wait_all(reads, time.monotonic() + 120, version=step)
            times = _steps(conn, dev, 1 + cfg["warm"], body)
            for r in reads:
                r.release()
        else:
            times = _steps(conn, dev, 1 + cfg["warm"], lambda step: None)
        conn.send({"times": times, "check": {"bytes": share * m}})
        conn.recv()
        agent.close()
    except BaseException:
        conn.send({"fatal": traceback.format_exc()[-3000:]})


def nccl_worker(role: str, rank: int, cfg: dict, conn) -> None:
    """Raw broadcast of ``cfg['nbytes']`` from the trainer's GPU to the worker's."""
    try:
        import torch.distributed as dist
        dev = cfg["devs"][0 if role == "trainer" else 1]
        cuda = dev.startswith("cuda")
        if cuda:
            torch.cuda.set_device(torch.device(dev))
        store = dist.TCPStore("127.0.0.1", cfg["port"], 2, role == "trainer",
                              timeout=datetime.timedelta(seconds=120))
        me = 0 if role == "trainer" else 1
        pg = (dist.ProcessGroupNCCL(store, me, 2, dist.ProcessGroupNCCL.Options()) if cuda
              else dist.ProcessGroupGloo(store, me, 2, datetime.timedelta(seconds=120)))
        buf = torch.ones(cfg["nbytes"], dtype=torch.uint8, device=dev)
        pg.broadcast(torch.ones(1, device=dev), 0).wait()   # connect
        conn.send("up")
        conn.recv()
        times = _steps(conn, dev, 1 + cfg["warm"], lambda step: pg.broadcast(buf, 0).wait())
        conn.send({"times": times, "check": None})
        conn.recv()
        if cuda:
            pg.shutdown()
    except BaseException:
        conn.send({"fatal": traceback.format_exc()[-3000:]})


def run(target, cfg: dict, trainers: int, workers: int, timeout: float = 300) -> list:
    """Start the processes, hand out the topology (nixl) or the trainers' regions (raw),
    start every step together; results, trainers first."""
    ctx = mp.get_context("spawn")
    roles = [("trainer", i) for i in range(trainers)] + [("rollout", j) for j in range(workers)]
    pipes, procs = [], []
    for role, rank in roles:
        a, b = ctx.Pipe()
        p = ctx.Process(target=target, args=(role, rank, cfg, b), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)

    def recv(c):
        if not c.poll(timeout):
            raise TimeoutError("a worker sent nothing in time")
        msg = c.recv()
        if isinstance(msg, dict) and "fatal" in msg:
            raise RuntimeError(msg["fatal"])
        return msg
    try:
        first = [recv(c) for c in pipes]
        if target is nixl_worker:
            tk, rk = CheckpointEngineRegistry.get("nixl").build_topology(trainers, workers, first)
            kws = [worker_kwargs(tk, i) for i in range(trainers)] + \
                  [worker_kwargs(rk, j) for j in range(workers)]
        elif target is raw_worker:
            kws = [None] * trainers + [first[:trainers]] * workers
        else:
            kws = [None] * len(pipes)
        for c, kw in zip(pipes, kws):
            c.send(kw)
        for _ in range(1 + cfg["warm"]):
            for c in pipes:
                if recv(c) != "ready":
                    raise RuntimeError("out of step")
            for c in pipes:
                c.send("go")
        out = [recv(c) for c in pipes]
        for c in pipes:
            c.send("bye")
        return out
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def summary(res: list, trainers: int) -> dict:
    """Per step the slowest worker; cold = first step, warm = median of the others."""
    workers = res[trainers:]
    steps = [max(w["times"][i] for w in workers) for i in range(len(workers[0]["times"]))]
    return {"cold_s": steps[0], "warm_s": statistics.median(steps[1:]), "steps_s": steps,
            "trainer_steps_s": [max(t["times"][i] for t in res[:trainers])
                                for i in range(len(steps))] if trainers else [],
            "workers": [w["check"] for w in workers],
            "trainers": [t["check"] for t in res[:trainers]]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--trainers", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1, help="rollout workers, each a TP slice")
    ap.add_argument("--shards", action="store_true", help="trainers yield Shard(0) DTensors")
    ap.add_argument("--devices", default="0,1", help="trainer GPU, workers' GPU, or 'cpu'")
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="scaled-down shapes (a dry run)")
    ap.add_argument("--consume", choices=("into", "copy"), default="into",
                    help="into: receive_into the workers' shards; copy: the README's "
                         "receive_weights loop, copying each kept box into the shard")
    ap.add_argument("--no-nccl", action="store_true")
    ap.add_argument("--raw-pieces", type=int, default=64,
                    help="also a raw READ of the same bytes in this many descriptors")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    for name in ("trainers", "tp", "warm"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1")
    devs = (["cpu", "cpu"] if args.devices == "cpu"
            else [f"cuda:{int(x)}" for x in args.devices.split(",")])
    spec = model_spec(int(args.gib * (1 << 30)), SMALL if args.small else LLAMA8B)
    total = sum(math.prod(s) for _, s, _ in spec) * 2
    cfg = {"spec": spec, "tp": args.tp, "trainers": args.trainers, "shards": args.shards,
           "devs": devs, "warm": args.warm, "consume": args.consume}
    res = {"case": f"{args.trainers} trainer ranks ({'Shard(0)' if args.shards else 'full'}) "
                   f"-> {args.tp} workers (TP {args.tp}), {args.consume}", "devices": devs,
           "model_bytes": total, "tensors": len(spec),
           "kept_bytes": [kept_bytes(spec, r, args.tp) for r in range(args.tp)]}
    n = run(nixl_worker, cfg, args.trainers, args.tp)
    res["nixl"] = summary(n, args.trainers)
    raw = run(raw_worker, cfg, args.trainers, args.tp)
    res["raw_read"] = summary(raw, args.trainers)
    res["nixl_vs_raw_read"] = res["raw_read"]["warm_s"] / res["nixl"]["warm_s"]
    if args.raw_pieces > 1:      # the same bytes in as many descriptors as a plan may have
        res["raw_read_pieces"] = dict(summary(run(raw_worker, dict(cfg, pieces=args.raw_pieces),
                                                  args.trainers, args.tp), args.trainers),
                                      pieces=args.raw_pieces)
    if not args.no_nccl:
        for key, nbytes in (("nccl_broadcast_model", total),
                            ("nccl_broadcast_slice", max(res["kept_bytes"]))):
            out = run(nccl_worker, dict(cfg, nbytes=nbytes, port=free_port()), 1, 1)
            res[key] = dict(summary(out, 1), bytes=nbytes)
        res["nixl_vs_nccl_model"] = res["nccl_broadcast_model"]["warm_s"] / res["nixl"]["warm_s"]
    res["nixl_GBps_per_worker"] = max(res["kept_bytes"]) / res["nixl"]["warm_s"] / 1e9
    print(json.dumps(res, default=str), flush=True)
    os.makedirs(args.out, exist_ok=True)
    tag = (f"nixl_multi_{args.trainers}to{args.tp}{'_shards' if args.shards else ''}"
           f"_{args.consume}.json")
    with open(os.path.join(args.out, tag), "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
