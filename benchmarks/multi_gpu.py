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
import faulthandler
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
from weightsync.transport.base import worker_kwargs  # noqa: E402
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


def _model(task: dict, role: str, dev: str) -> tuple[list, dict, int]:
    """The bench model: random on trainers (same seed on each), empty on rollout ranks."""
    spec = model_spec(task["gb"])
    g = torch.Generator(device=dev).manual_seed(0)
    if task.get("cpu"):
        spec = [(n, tuple(max(1, d // 64) for d in s)) for n, s in spec]
    params = {n: (torch.randn(s, generator=g, device=dev, dtype=torch.bfloat16) if role == "trainer"
                  else torch.empty(s, device=dev, dtype=torch.bfloat16)) for n, s in spec}
    return spec, params, sum(p.numel() * 2 for p in params.values())


def _landed(spec: list, params: dict, dev: str) -> bool:
    """Spot check on a rollout rank: the first tensors equal the trainers' (same seed)."""
    g = torch.Generator(device=dev).manual_seed(0)
    return all(torch.equal(params[n], torch.randn(s, generator=g, device=dev,
                                                  dtype=torch.bfloat16)) for n, s in spec[:3])


async def task_bench(eng, role, rank, dev, task):
    spec, params, nbytes = _model(task, role, dev)
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
        elif task.get("consume") == "into":     # straight into the parameters
            async for _ in eng.receive_into(params, version=step):
                pass
        else:                                   # the README's loop
            async for name, t in eng.receive_weights(version=step):
                params[name].copy_(t)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    ok = role != "rollout" or _landed(spec, params, dev)   # the last sync, bit-exact
    peak = torch.cuda.max_memory_allocated(dev) if dev.startswith("cuda") else 0
    return {"bytes": nbytes, "raw_s": raw[1:], "cold_s": times[0], "warm_s": times[1:],
            "exact": ok, "peak_alloc": peak, "params_bytes": nbytes}


def _groups(task: dict, role: str, rank: int) -> tuple:
    """A group of every process (barriers) and, per trainer rank this process talks to, a
    raw broadcast group of that trainer with every rollout rank."""
    t, size = task["trainers"], task["size"]
    me = rank if role == "trainer" else t + rank
    store = dist.TCPStore("127.0.0.1", task["raw_port"], size, me == 0,
                          timeout=datetime.timedelta(seconds=120))

    def group(name: str, r: int, n: int) -> dist.ProcessGroup:
        pre = dist.PrefixStore(f"{task['name']}-{name}", store)
        if task.get("cpu"):
            return dist.ProcessGroupGloo(pre, r, n, datetime.timedelta(seconds=120))
        return dist.ProcessGroupNCCL(pre, r, n, dist.ProcessGroupNCCL.Options())

    everyone = group("all", me, size)
    mine = [i for i in range(t) if role == "rollout" or i == rank]
    return store, everyone, {i: group(f"s{i}", 0 if role == "trainer" else 1 + rank,
                                      size - t + 1) for i in mine}


async def task_senders(eng, role, rank, dev, task):
    """``trainers`` senders, each yielding the whole model (as FSDP2 ranks yielding full
    tensors do; after the first sync each tensor goes from one owner), to every rollout
    rank. Raw reference: each sender broadcasts an equal share of the bytes at once."""
    spec, params, nbytes = _model(task, role, dev)
    _store, everyone, raw_pgs = _groups(task, role, rank)   # the store outlives the groups
    _barrier(everyone, dev)
    share = -(-nbytes // task["trainers"])
    flats = {i: torch.empty(share, dtype=torch.uint8, device=dev) for i in raw_pgs}
    raw, times, sent = [], [], []
    for _ in range(task["warm"] + 1):
        _barrier(everyone, dev)
        t0 = time.perf_counter()
        for w in [pg.broadcast(flats[i], 0) for i, pg in raw_pgs.items()]:
            w.wait()
        _sync(dev)
        raw.append(time.perf_counter() - t0)
    del flats
    for step in range(task["warm"] + 1):
        _barrier(everyone, dev)
        t0 = time.perf_counter()
        if role == "trainer":
            sent.append((await eng.send_weights(params.items(), version=step))["bytes"])
        else:
            async for name, t in eng.receive_weights(version=step):
                params[name].copy_(t)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    _barrier(everyone, dev)
    return {"bytes": nbytes, "raw_s": raw, "sync_s": times, "sent": sent,
            "exact": role != "rollout" or _landed(spec, params, dev)}


def summarize_senders(res: list, trainers: int) -> dict:
    """Per step the slowest process; warm: median over the steps after the first."""
    out = [r["result"] for r in res]
    steps = lambda key: [max(r[key][i] for r in out) for i in range(len(out[0][key]))]  # noqa
    raw, sync = steps("raw_s"), steps("sync_s")
    warm, raw_w = statistics.median(sync[1:]), statistics.median(raw[1:])
    nbytes = out[0]["bytes"]
    return {"senders": trainers, "receivers": len(out) - trainers, "GB": nbytes / 1e9,
            "cold_s": sync[0], "warm_s": warm, "raw_s": raw_w, "warm_GBps": nbytes / warm / 1e9,
            "raw_GBps": nbytes / raw_w / 1e9, "ratio_vs_raw": raw_w / warm,
            "warm_bytes_per_sender": [r["sent"][-1] for r in out[:trainers]],
            "exact": all(r["exact"] for r in out)}


TASKS = {"conformance": task_conformance, "bench": task_bench, "senders": task_senders}


def worker(role, rank, gpu, task, conn):
    try:
        dev = "cpu" if task.get("cpu") else f"cuda:{gpu}"
        if not task.get("cpu"):
            torch.cuda.set_device(gpu)
        if task.get("watchdog"):  # stacks of a worker still running then (a hang)
            faulthandler.dump_traceback_later(task["watchdog"], exit=False)
        kw = dict(task.get("engine", {}))
        kw.setdefault("timeout", 180)
        eng = CheckpointEngineRegistry.new("collective", role=role, device=dev,
                                           bucket_size=task["bucket"], **kw)
        conn.send(eng.prepare())
        eng.init_process_group(**conn.recv())
        result = asyncio.run(TASKS[task["kind"]](eng, role, rank, dev, task))
        eng.finalize()
        conn.send({"role": role, "rank": rank, "result": result})
    except BaseException:
        conn.send({"role": role, "rank": rank, "fatal": traceback.format_exc()[-3000:]})


def launch(task: dict, ngpu: int, timeout: float = 600, *, trainers: int = 1,
           gpus: list | None = None) -> list:
    """One process per GPU of ``gpus`` (default: the first ``ngpu``): the first
    ``trainers`` are trainer ranks, the others rollout ranks. Results, trainers first."""
    ctx = mp.get_context("spawn")
    gpus = list(range(ngpu)) if gpus is None else list(gpus)
    receivers = len(gpus) - trainers
    roles = [("trainer", i, gpus[i]) for i in range(trainers)] + \
        [("rollout", j, gpus[trainers + j]) for j in range(receivers)]
    task = dict(task, size=len(roles), trainers=trainers)
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
        tk, rk = cls.build_topology(trainers, receivers, metas)
        for i in range(trainers):
            pipes[i].send(worker_kwargs(tk, i))
        for j in range(receivers):
            pipes[trainers + j].send(worker_kwargs(rk, j))
        return [c.recv() if c.poll(timeout) else {"fatal": "timeout"} for c in pipes]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def summarize_bench(res: list, bucket: int, consume: str = "copy") -> dict:
    t, r = res[0]["result"], res[1]["result"]
    warm = statistics.median([max(a, b) for a, b in zip(t["warm_s"], r["warm_s"])])
    raw = statistics.median([max(a, b) for a, b in zip(t["raw_s"], r["raw_s"])])
    return {"bucket_MiB": bucket >> 20, "consume": consume, "GB": t["bytes"] / 1e9, "cold_s": max(t["cold_s"], r["cold_s"]),
            "warm_s": warm, "raw_s": raw, "warm_GBps": t["bytes"] / warm / 1e9,
            "raw_GBps": t["bytes"] / raw / 1e9, "ratio_vs_raw": raw / warm,
            "exact": r["exact"],
            "extra_dev_mem_GiB": (r["peak_alloc"] - r["params_bytes"] - t["bytes"]) / GiB}


def run_conformance(args, ngpu: int) -> list:
    """Every case with one trainer and a rollout rank on each other GPU; with 4 GPUs or
    more also two trainer ranks (both yielding everything) to the other GPUs."""
    conf = []
    cases = (("plain", {}, 1), ("cast_bf16", {"engine": {"dtype": "bfloat16"},
                                             "dtype": torch.bfloat16}, 1),
             ("version_mismatch", {"offset": 1000, "steps": 1, "engine": {"timeout": 30},
                                   "watchdog": 60}, 1),
             ("two_senders", {}, 2))
    for name, extra, trainers in cases:
        if name not in args.cases.split(",") or (trainers > 1 and ngpu < 2 * trainers):
            continue
        task = {"kind": "conformance", "name": name, "bucket": 1 << 20, "steps": 3,
                "cpu": args.cpu, **extra}
        start = time.monotonic()
        res = launch(task, ngpu, timeout=120 if "watchdog" in extra else 600,
                     trainers=trainers)
        conf.append({"case": name, "trainers": trainers, "receivers": ngpu - trainers,
                     "seconds": round(time.monotonic() - start, 1), "workers": res})
        print(name, json.dumps(conf[-1], default=str)[:1500], flush=True)
    return conf


def run_bench(args, ngpu: int, port: int) -> list:
    bench = []
    cases = [(int(m), c) for m in args.buckets.split(",") if m for c in args.consume.split(",")]
    for mib, consume in cases:
        port += 1
        task = {"kind": "bench", "name": f"b{mib}{consume}", "bucket": mib << 20, "gb": args.gb,
                "warm": args.warm, "raw_port": port, "cpu": args.cpu, "consume": consume}
        res = launch(task, min(ngpu, 2))
        row = summarize_bench(res, mib << 20, consume) if all("result" in x for x in res) \
            else {"error": res}
        bench.append(row)
        print("bench", json.dumps(row, default=str)[:2000], flush=True)
    return bench


def run_senders(args, ngpu: int, port: int) -> list:
    """One sender (GPU 0) and two senders (GPUs 0, 1) to the same rollout ranks (GPUs 2..)."""
    rows = []
    for trainers, gpus in ((1, [0] + list(range(2, ngpu))), (2, list(range(ngpu)))):
        port += 1
        task = {"kind": "senders", "name": f"s{trainers}", "bucket": args.senders_bucket << 20,
                "gb": args.gb, "warm": args.warm, "raw_port": port, "cpu": args.cpu}
        res = launch(task, ngpu, trainers=trainers, gpus=gpus)
        row = summarize_senders(res, trainers) if all("result" in x for x in res) \
            else {"senders": trainers, "error": res}
        rows.append(row)
        print("senders", json.dumps(row, default=str)[:2000], flush=True)
    if all("warm_s" in r for r in rows):
        rows.append({"scaling_2_over_1": rows[0]["warm_s"] / rows[1]["warm_s"],
                     "raw_scaling_2_over_1": rows[0]["raw_s"] / rows[1]["raw_s"]})
        print("senders", json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--gb", type=float, default=16.0)
    ap.add_argument("--buckets", default="512,1024,2048", help="bucket sweep, 1 -> 1 ('' none)")
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--consume", default="copy",
                    help="comma list: copy (receive_weights + copy_, the README's loop), "
                         "into (receive_into the parameters)")
    ap.add_argument("--cpu", type=int, default=0,
                    help="dry run of the script on gloo/CPU with this many processes")
    ap.add_argument("--cases", default="plain,cast_bf16,version_mismatch,two_senders",
                    help="conformance cases to run ('' for none)")
    ap.add_argument("--senders", action="store_true",
                    help="one vs two senders to the other GPUs (needs 4 GPUs)")
    ap.add_argument("--senders-bucket", type=int, default=1024, help="MiB")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ngpu = args.cpu or torch.cuda.device_count()
    report = {"device": "cpu (dry run)" if args.cpu else torch.cuda.get_device_name(0),
              "gpus": ngpu, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
              "nccl": None if args.cpu else ".".join(map(str, torch.cuda.nccl.version())),
              "command": " ".join(sys.argv)}
    print(json.dumps(report), flush=True)
    report["conformance"] = run_conformance(args, ngpu)
    report["bench"] = run_bench(args, ngpu, 29611)
    if args.senders and ngpu >= 4:
        report["senders"] = run_senders(args, ngpu, 29711)
    with open(os.path.join(args.out, "multi_gpu.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
