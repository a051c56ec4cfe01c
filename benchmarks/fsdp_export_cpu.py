"""The FSDP2 export as a trainer runs it (``export_weights`` over a ``fully_shard`` model), on
CPU, 2 ranks over gloo: Llama-like layers (hidden 2048, MLP 5632, ``--layers``), fp32
parameters exported as bf16 (``--cast``, as a trainer with fp32 master weights does) or as
they are; per rank, the median seconds of ``--reps`` whole exports (every tensor it owns
iterated, nothing else done with it) and the export's ``torch.cat`` calls.
``SRC=<src folder>`` runs another tree (before/after on the same box state).

    .venv/bin/python benchmarks/fsdp_export_cpu.py --layers 6 --cast
"""
import argparse, datetime, json, os, socket, statistics, sys, time
sys.path.insert(0, os.environ.get("SRC", os.path.join(os.path.dirname(__file__), "..", "src")))
import torch, torch.distributed as dist, torch.multiprocessing as mp


class Layer(torch.nn.Module):
    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(h, h, bias=False) for _ in range(4))
        self.gate, self.up = torch.nn.Linear(h, i, bias=False), torch.nn.Linear(h, i, bias=False)
        self.down = torch.nn.Linear(i, h, bias=False)
        self.norm = torch.nn.LayerNorm(h)


def worker(rank, world, port, args, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from weightsync.trainer.export import export_weights
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Layer(2048, 5632) for _ in range(args.layers)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dtype = torch.bfloat16 if args.cast else None
    cats, real_cat = [0], torch.cat

    def counted(*a, **k):
        cats[0] += 1
        return real_cat(*a, **k)
    torch.cat = counted
    ts, nbytes = [], 0
    for _ in range(args.reps):
        dist.barrier()
        t = time.perf_counter()
        nbytes = sum(x.numel() * x.element_size() for _, x in export_weights(model, dtype=dtype))
        ts.append(time.perf_counter() - t)
    out.put({"rank": rank, "median_s": round(statistics.median(ts), 4), "min_s": round(min(ts), 4),
             "GB_owned": round(nbytes / 1e9, 3), "cats_per_export": cats[0] // args.reps})
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--cast", action="store_true", help="fp32 parameters exported as bf16")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, 2, port, args, q)) for r in range(2)]
    [p.start() for p in ps]
    rows = sorted((q.get(), q.get()), key=lambda r: r["rank"])
    print(json.dumps({"args": vars(args), "src": os.environ.get("SRC", "this tree"), "ranks": rows}))
    [p.join() for p in ps]
