"""Raw gloo on CPU, no weightsync: one broadcast of 1 GiB against the same bytes as the
synthetic 1 GiB set's direct tensors (each its own broadcast, up to AHEAD in flight on both
sides) plus one for the rest. Shows what gloo itself charges per operation on this box, the
floor for `collective`'s direct tensors. Two processes, TCPStore(port=0), one torch thread.

    .venv/bin/python benchmarks/gloo_ops_cpu.py      # env MIN (bytes, default 16 MiB), AHEAD (2)

``TRACE=DIR``: every operation's post and completion in the last split run, as
DIR/rawtrace_<rank>.txt (ms from its start, post/done, MiB), as ``collective_cpu.py`` writes.
"""
import datetime, math, os, statistics, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
N = 1 << 30
MIN = int(os.environ.get("MIN", 16 << 20))
AHEAD = int(os.environ.get("AHEAD", 2))


def sizes() -> list:
    from weightsync.tools.bench.workloads import synthetic
    w = synthetic(N, "bfloat16", bucket_size=64 << 20)
    all_ = [math.prod(s) * 2 for _, s in w.tensors]
    direct = [x for x in all_ if x >= MIN]
    return direct + [sum(x for x in all_ if x < MIN)]


def main(rank: int, port: int, q) -> None:
    torch.set_num_threads(1)
    td = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, is_master=(rank == 0), timeout=td,
                          wait_for_workers=False)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("ops", store), rank, 2, td)
    flat = torch.zeros(N, dtype=torch.uint8)
    parts = [torch.zeros(n, dtype=torch.uint8) for n in sizes()]
    pg.broadcast(flat[:4096], 0).wait()

    def one() -> float:
        t = time.perf_counter()
        pg.broadcast(flat, 0).wait()
        return time.perf_counter() - t

    log = []

    def many() -> float:
        log.clear()
        t, inflight = time.perf_counter(), []
        for p in parts:
            log.append((time.perf_counter() - t, "post", p.numel() >> 20))
            inflight.append((pg.broadcast(p, 0), p.numel() >> 20))
            while len(inflight) >= AHEAD:
                w, n = inflight.pop(0)
                w.wait()
                log.append((time.perf_counter() - t, "done", n))
        for w, n in inflight:
            w.wait()
            log.append((time.perf_counter() - t, "done", n))
        return time.perf_counter() - t
    rows = {"flat": [], "ops": []}
    for _ in range(7):
        rows["flat"].append(one())
        rows["ops"].append(many())
    if os.environ.get("TRACE"):
        with open(os.path.join(os.environ["TRACE"], f"rawtrace_{rank}.txt"), "w") as fh:
            fh.writelines(f"{a * 1e3:8.2f} {k} {n}\n" for a, k, n in log)
    if rank == 0:
        f, o = statistics.median(rows["flat"]), statistics.median(rows["ops"])
        q.put({"min_bytes": MIN, "ahead": AHEAD, "ops": len(parts), "flat_s": round(f, 4),
               "ops_s": round(o, 4), "flat / ops": round(f / o, 3),
               "ms per extra op": round((o - f) / (len(parts) - 1) * 1e3, 3)})


if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=main, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    print(q.get(timeout=300))
    for p in procs:
        p.join(60)
