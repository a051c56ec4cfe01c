"""Multi-GPU run of the ``collective`` engine on NCCL (issue: multi-GPU runs).

One process per GPU. Part 1, conformance: trainer on GPU 0, one rollout rank on each other
GPU; three syncs of the conformance tensor set (every dtype, 0-d, empty, non-contiguous,
bigger than a bucket, many tiny), a bf16-cast sync and a version mismatch. Part 2, bench:
a ~16 GB bf16 transformer-shaped model from GPU 0 into preallocated parameters on GPU 1,
cold + warm syncs per bucket size, next to a raw NCCL broadcast of one flat buffer of the
same bytes in the same processes.

    python benchmarks/multi_gpu.py --out results_dir [--gb 16]

Keeps NVLink multicast off (NCCL_NVLS_ENABLE=0 and friends), as the device rules ask.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import time
import traceback

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from weightsync import CheckpointEngineRegistry  # noqa: E402
from weightsync.engines.base import worker_kwargs  # noqa: E402
from weightsync.testing import expected_tensors, make_tensors, same_bytes  # noqa: E402

GiB = 1 << 30


def model_spec(gb: float) -> list[tuple[str, tuple[int, ...]]]:
    """Transformer-shaped bf16 tensors: embedding (bigger than a bucket), layers, norms."""
    h, ffn, vocab = 8192, 28672, 128256
    spec = [("embed_tokens.weight", (vocab, h))]
    per_layer = (4 * h * h + 3 * h * ffn + 2 * h) * 2
    layers = max(1, int((gb * 1e9 - vocab * h * 2) // per_layer))
    for i in range(layers):
        p = f"layers.{i}."
        spec += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (h, h)),
                 (p + "self_attn.v_proj.weight", (h, h)), (p + "self_attn.o_proj.weight", (h, h)),
                 (p + "mlp.gate_proj.weight", (ffn, h)), (p + "mlp.up_proj.weight", (ffn, h)),
                 (p + "mlp.down_proj.weight", (h, ffn)), (p + "input_layernorm.weight", (h,)),
                 (p + "post_attention_layernorm.weight", (h,))]
    return spec + [("norm.weight", (h,))]


def _raw_group(task: dict, rank: int, size: int) -> dist.ProcessGroup:
    store = dist.TCPStore("127.0.0.1", task["raw_port"], size, rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    prefixed = dist.PrefixStore(task["name"], store)
    if task.get("cpu"):
        return dist.ProcessGroupGloo(prefixed, rank, size, datetime.timedelta(seconds=120))
    return dist.ProcessGroupNCCL(prefixed, rank, size, dist.ProcessGroupNCCL.Options())


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize(dev)


def _barrier(pg: dist.ProcessGroup, dev: str) -> None:
    t = torch.ones(1, device=dev)
    pg.allreduce(t).wait()
    _sync(dev)


async def task_conformance(eng, role, rank, dev, task):
    bs, out = task["bucket"], []
    for step in range(task["steps"]):
        version = step + task.get("offset", 0) if role == "rollout" else step
        try:
            if role == "trainer":
                items = [(n, t.to(dev)) for n, t in make_tensors(step, bucket_size=bs, tiny=500)]
                out.append(await eng.send_weights(items, version=step))
                continue
            exp = expected_tensors(step, bucket_size=bs, tiny=500, dtype=task.get("dtype"))
            got, bad = {}, []
            async for name, t in eng.receive_weights(version=version):
                got[name] = got.get(name, 0) + 1
                if name not in exp or not same_bytes(t, exp[name]):
                    bad.append(name)
            out.append({"missing": sorted(set(exp) - set(got))[:5], "bad": bad[:5],
                        "dupes": [n for n, c in got.items() if c > 1][:5], "count": len(got)})
        except Exception as exc:
            out.append({"error": f"{type(exc).__name__}: {exc}"[:500]})
            break
    return out


async def task_bench(eng, role, rank, dev, task):
    spec = model_spec(task["gb"])
    g = torch.Generator(device=dev).manual_seed(0)
    if task.get("cpu"):
        spec = [(n, tuple(max(1, d // 64) for d in s)) for n, s in spec]
    params = {n: (torch.randn(s, generator=g, device=dev, dtype=torch.bfloat16) if role == "trainer"
                  else torch.empty(s, device=dev, dtype=torch.bfloat16)) for n, s in spec}
    nbytes = sum(p.numel() * 2 for p in params.values())
    pg = _raw_group(task, 0 if role == "trainer" else 1 + rank, task["size"])
    _barrier(pg, dev)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    raw = []
    for _ in range(task["warm"] + 1):
        _barrier(pg, dev)
        t0 = time.perf_counter()
        pg.broadcast(flat, 0).wait()
        _sync(dev)
        raw.append(time.perf_counter() - t0)
    del flat
    times = []
    for step in range(task["warm"] + 1):
        _barrier(pg, dev)
        t0 = time.perf_counter()
        if role == "trainer":
            await eng.send_weights(params.items(), version=step)
        else:
            async for name, t in eng.receive_weights(version=step):
                params[name].copy_(t)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    ok = True
    if role == "rollout":  # spot-check: the last sync landed bit-exact
        g2 = torch.Generator(device=dev).manual_seed(0)
        for n, s in spec[:3]:
            ok &= bool(torch.equal(params[n], torch.randn(s, generator=g2, device=dev,
                                                          dtype=torch.bfloat16)))
    peak = torch.cuda.max_memory_allocated(dev) if dev.startswith("cuda") else 0
    return {"bytes": nbytes, "raw_s": raw[1:], "cold_s": times[0], "warm_s": times[1:],
            "exact": ok, "peak_alloc": peak, "params_bytes": nbytes}


TASKS = {"conformance": task_conformance, "bench": task_bench}


def worker(role, rank, gpu, task, conn):
    try:
        dev = "cpu" if task.get("cpu") else f"cuda:{gpu}"
        if not task.get("cpu"):
            torch.cuda.set_device(gpu)
        kw = dict(task.get("engine", {}))
        eng = CheckpointEngineRegistry.new("collective", role=role, device=dev,
                                           bucket_size=task["bucket"], timeout=180, **kw)
        conn.send(eng.prepare())
        eng.init_process_group(**conn.recv())
        result = asyncio.run(TASKS[task["kind"]](eng, role, rank, dev, task))
        eng.finalize()
        conn.send({"role": role, "rank": rank, "result": result})
    except BaseException:
        conn.send({"role": role, "rank": rank, "fatal": traceback.format_exc()[-3000:]})


def launch(task: dict, ngpu: int, timeout: float = 600) -> list:
    ctx = mp.get_context("spawn")
    roles = [("trainer", 0, 0)] + [("rollout", j, j + 1) for j in range(ngpu - 1)]
    task = dict(task, size=len(roles))
    pipes, procs = [], []
    for role, rank, gpu in roles:
        a, b = ctx.Pipe()
        p = ctx.Process(target=worker, args=(role, rank, gpu, task, b), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    try:
        metas = [c.recv() if c.poll(timeout) else {"fatal": "no prepare"} for c in pipes]
        if any("fatal" in m for m in metas):
            return metas
        cls = CheckpointEngineRegistry.get("collective")
        tk, rk = cls.build_topology(1, ngpu - 1, metas)
        pipes[0].send(worker_kwargs(tk, 0))
        for j in range(ngpu - 1):
            pipes[j + 1].send(worker_kwargs(rk, j))
        return [c.recv() if c.poll(timeout) else {"fatal": "timeout"} for c in pipes]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def summarize_bench(res: list, bucket: int) -> dict:
    t, r = res[0]["result"], res[1]["result"]
    warm = statistics.median([max(a, b) for a, b in zip(t["warm_s"], r["warm_s"])])
    raw = statistics.median([max(a, b) for a, b in zip(t["raw_s"], r["raw_s"])])
    return {"bucket_MiB": bucket >> 20, "GB": t["bytes"] / 1e9, "cold_s": max(t["cold_s"], r["cold_s"]),
            "warm_s": warm, "raw_s": raw, "warm_GBps": t["bytes"] / warm / 1e9,
            "raw_GBps": t["bytes"] / raw / 1e9, "ratio_vs_raw": raw / warm,
            "exact": r["exact"],
            "extra_dev_mem_GiB": (r["peak_alloc"] - r["params_bytes"] - t["bytes"]) / GiB}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--gb", type=float, default=16.0)
    ap.add_argument("--buckets", default="512,1024,2048")
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="dry run of the script on gloo/CPU")
    ap.add_argument("--cases", default="plain,cast_bf16,version_mismatch",
                    help="conformance cases to run ('' for none)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ngpu = 2 if args.cpu else torch.cuda.device_count()
    report = {"device": "cpu (dry run)" if args.cpu else torch.cuda.get_device_name(0),
              "gpus": ngpu, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
              "nccl": None if args.cpu else ".".join(map(str, torch.cuda.nccl.version()))}
    print(json.dumps(report), flush=True)
    port = 29611
    conf = []
    for name, extra in (("plain", {}), ("cast_bf16", {"engine": {"dtype": "bfloat16"},
                                                      "dtype": torch.bfloat16}),
                        ("version_mismatch", {"offset": 1000, "steps": 1})):
        if name not in args.cases.split(","):
            continue
        task = {"kind": "conformance", "name": name, "bucket": 1 << 20, "steps": 3,
                "cpu": args.cpu, **extra}
        res = launch(task, ngpu)
        conf.append({"case": name, "workers": res})
        print(name, json.dumps(res, default=str)[:1500], flush=True)
    report["conformance"] = conf
    bench = []
    for mib in [int(x) for x in args.buckets.split(",")]:
        port += 1
        task = {"kind": "bench", "name": f"b{mib}", "bucket": mib << 20, "gb": args.gb,
                "warm": args.warm, "raw_port": port, "cpu": args.cpu}
        res = launch(task, min(ngpu, 2))
        row = summarize_bench(res, mib << 20) if all("result" in x for x in res) else {"error": res}
        bench.append(row)
        print("bench", json.dumps(row, default=str)[:2000], flush=True)
    report["bench"] = bench
    with open(os.path.join(args.out, "multi_gpu.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
