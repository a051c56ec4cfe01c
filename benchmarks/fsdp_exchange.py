"""FSDP2 export on CPU, 2 ranks over gloo, Llama-like layers (hidden 2048, MLP 5632,
``--layers``) of fp32 parameters, exported as bf16 (``--cast``, as a trainer with fp32
master weights does) or as they are; median seconds of ``--reps`` runs of:

* default: the coalesced exchange alone (``gather_many_to_owners`` of every tensor at once),
  with the peak RSS growth of rank 0;
* ``--export``: the export as a trainer runs it (``export_weights`` over a ``fully_shard``
  model: 16 MiB exchanges, every tensor the rank owns iterated, nothing else done with it),
  per rank, with the ``torch.cat`` calls per export.

``SRC=<src folder>`` runs another tree (before/after on the same box state).

    .venv/bin/python benchmarks/fsdp_exchange.py --layers 4 --cast
    .venv/bin/python benchmarks/fsdp_exchange.py --layers 6 --cast --export
"""
import argparse, datetime, json, os, resource, socket, statistics, sys, time
sys.path.insert(0, os.environ.get("SRC", os.path.join(os.path.dirname(__file__), "..", "src")))
import torch, torch.distributed as dist, torch.multiprocessing as mp

H, I = 2048, 5632
SHAPES = [(H, H)] * 4 + [(I, H), (I, H), (H, I)]


class Layer(torch.nn.Module):
    """The SHAPES as linear layers (q, k, v, o, gate, up, down) and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.ModuleList(torch.nn.Linear(i, o, bias=False) for o, i in SHAPES)
        self.norm = torch.nn.LayerNorm(H)


def exchange(mesh, args) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor
    from weightsync.trainer import fsdp
    world, rank = mesh.size(), dist.get_rank()
    dts = [distribute_tensor(torch.randn(s), mesh, [Shard(0)]) for _ in range(args.layers) for s in SHAPES]
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
    return {"rank": rank, "median_s": statistics.median(ts), "min_s": min(ts), "GB": nbytes / 1e9,
            "peak_rss_growth_MiB": peak / 1024}


def export(mesh, args) -> dict:
    from torch.distributed.fsdp import fully_shard
    from weightsync.trainer.export import export_weights
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Layer() for _ in range(args.layers)))
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
    return {"rank": dist.get_rank(), "median_s": round(statistics.median(ts), 4),
            "min_s": round(min(ts), 4), "GB_owned": round(nbytes / 1e9, 3),
            "cats_per_export": cats[0] // args.reps}


def worker(rank, world, port, args, out):
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    row = (export if args.export else exchange)(mesh, args)
    if args.export or rank == 0:
        out.put(row)
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--cast", action="store_true", help="fp32 shards exported as bf16")
    ap.add_argument("--export", action="store_true", help="time export_weights of an FSDP2 model")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, 2, port, args, q)) for r in range(2)]
    [p.start() for p in ps]
    rows = sorted((q.get() for _ in range(2 if args.export else 1)), key=lambda r: r["rank"])
    print(json.dumps({"args": vars(args), "src": os.environ.get("SRC", "this tree"),
                      **({"ranks": rows} if args.export else rows[0])}))
    [p.join() for p in ps]
