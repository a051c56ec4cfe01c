"""FSDP2 export's coalesced exchange (``gather_many_to_owners``) on CPU, 2 ranks over gloo:
fp32 shards (Llama-like layer shapes, ``--layers``), exported as bf16 (``--cast``) or as
they are; median seconds of ``--reps`` exchanges and the peak RSS growth of rank 0.
``SRC=<src folder>`` runs another tree (before/after on the same box state).

    .venv/bin/python benchmarks/fsdp_exchange.py --layers 4 --cast
"""
import argparse, datetime, json, os, resource, socket, statistics, sys, time
sys.path.insert(0, os.environ.get("SRC", os.path.join(os.path.dirname(__file__), "..", "src")))
import torch, torch.distributed as dist, torch.multiprocessing as mp


def worker(rank, world, port, args, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from weightsync.trainer import fsdp
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    h, i = 2048, 5632
    shapes = [(h, h)] * 4 + [(i, h), (i, h), (h, i)]
    dts = [distribute_tensor(torch.randn(s), mesh, [Shard(0)]) for _ in range(args.layers) for s in shapes]
    owners = [k % world for k in range(len(dts))]
    dtypes = [torch.bfloat16 if args.cast else None] * len(dts)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ts = []
    for _ in range(args.reps):
        dist.barrier()
        t = time.perf_counter()
        got = fsdp.gather_many_to_owners(dts, owners, dtypes, mesh.get_group())
        ts.append(time.perf_counter() - t)
        del got
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    nbytes = sum(d.numel() for d in dts) * (2 if args.cast else 4)
    if rank == 0:
        out.put({"median_s": statistics.median(ts), "min_s": min(ts), "GB": nbytes / 1e9,
                 "peak_rss_growth_MiB": peak / 1024})
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--cast", action="store_true", help="fp32 shards exported as bf16")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, 2, port, args, q)) for r in range(2)]
    [p.start() for p in ps]
    print(json.dumps({"args": vars(args), **q.get()}))
    [p.join() for p in ps]
