"""CPU `collective` against raw gloo, paired in the same two processes (1 GiB synthetic
bf16, one receiver, `receive_into`): 16 syncs, each right after one flat gloo broadcast of
the same bytes; prints the medians and the per-step ratio (`WORKLOAD=qwen2`: the bench's
config-built Qwen2 shapes instead; the flat broadcast stays 1 GiB). `SRC=<a src folder>` runs
another tree's weightsync (e.g. a `git archive` of an older commit) for a before/after on
the same box state; engine environment variables (WEIGHTSYNC_COLLECTIVE_*) apply as usual.
`TRACE=DIR`: every gloo broadcast the engine posts, and when it was seen complete, in the
last sync, as DIR/trace_<rank>.txt (ms from the sync's start, post/done, MiB). `THREADS=1`:
each process's CPU seconds per thread name (``/proc/self/task``), per flat broadcast and
per sync, averaged over the 16 pairs.

    .venv/bin/python benchmarks/collective_cpu.py
"""
import asyncio, datetime, os, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp
sys.path.insert(0, os.environ.get("SRC", "/work/main/src"))
N = 1 << 30
CPU = []
def tasks():
    """CPU seconds so far of each of this process's threads: {(tid, name): s}."""
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            st = open(f"/proc/self/task/{t}/stat").read()
        except FileNotFoundError:
            continue
        f = st[st.rindex(")") + 2:].split()
        out[(t, st[st.index("(") + 1:st.rindex(")")])] = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    return out
def add_use(into, a, b, share):
    for (tid, name), v in b.items():
        into[name] = into.get(name, 0.0) + (v - a.get((tid, name), 0.0)) * share
def flat(pg, buf, k=5):
    ts = []
    for _ in range(k):
        c = time.process_time(); t = time.perf_counter(); pg.broadcast(buf, 0).wait(); ts.append(time.perf_counter() - t); CPU.append(("flat", time.process_time() - c))
    return sorted(ts)[len(ts)//2]
def main(rank, port, q, qs):
    torch.set_num_threads(1)
    td = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, is_master=(rank == 0), timeout=td, use_libuv=True, wait_for_workers=False)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("flat", store), rank, 2, td)
    buf = (torch.ones if rank == 0 else torch.zeros)(N, dtype=torch.uint8)
    pg.broadcast(buf[:4096], 0).wait()
    r = {"flat_alone": flat(pg, buf)}
    from weightsync.tools.bench.workloads import hf_qwen2, synthetic
    if os.environ.get("WORKLOAD") == "qwen2":   # the bench's config-built Qwen2 (~0.5B)
        w = hf_qwen2("bfloat16")[0]
    else:
        w = synthetic(N, "bfloat16", bucket_size=64 << 20)
    params = {n: torch.randn(s).to(torch.bfloat16) for n, s in w.tensors}
    from weightsync.transport import CheckpointEngineRegistry
    from weightsync.transport.base import worker_kwargs
    cls = CheckpointEngineRegistry.get("collective")
    eng = cls(role="trainer" if rank == 0 else "rollout", bucket_size=64 << 20, timeout=60)
    meta = eng.prepare()
    q[rank].put(meta)
    if rank == 0:
        metas = [q[0].get(), q[1].get()]
        tk, rk = cls.build_topology(1, 1, metas)
        qs.put(worker_kwargs(rk, 0)); kw = worker_kwargs(tk, 0)
    else:
        kw = qs.get()
    eng.init_process_group(**kw)
    LOG, T0 = [], [0.0]
    if os.environ.get("TRACE"):
        class W:   # a gloo work, logging when it is first seen complete
            def __init__(s, w, n): s.w, s.n, s.done = w, n, False
            def is_completed(s):
                c = s.w.is_completed()
                if c and not s.done: s.done = True; LOG.append((time.perf_counter() - T0[0], "done", s.n))
                return c
            def wait(s, *a):
                r = s.w.wait(*a)
                s.is_completed()
                return r
        class G:   # the engine's group, logging each broadcast it posts
            def __init__(s, g): s.g = g
            def broadcast(s, t, root):
                LOG.append((time.perf_counter() - T0[0], "post", t.numel()))
                return W(s.g.broadcast(t, root), t.numel())
            def __getattr__(s, k): return getattr(s.g, k)
        for k in list(eng._groups): eng._groups[k] = G(eng._groups[k])
    loop = asyncio.new_event_loop()
    async def rx(v):
        async for _ in eng.receive_into(params, version=v): pass
    def sync(v):
        LOG.clear(); T0[0] = time.perf_counter()
        c = time.process_time(); t = time.perf_counter()
        if rank == 0: loop.run_until_complete(eng.send_weights(params.items(), version=v))
        else: loop.run_until_complete(rx(v))
        CPU.append(("sync", time.process_time() - c))
        return time.perf_counter() - t
    sync(1)
    r["flat_engine_idle"] = flat(pg, buf)
    ts = []; fs = []
    use = {"flat": {}, "sync": {}}
    for v in range(2, 18):
        a = tasks(); fs.append(flat(pg, buf, 1)); b = tasks(); ts.append(sync(v)); c = tasks()
        add_use(use["flat"], a, b, 1 / 16); add_use(use["sync"], b, c, 1 / 16)
    if os.environ.get("THREADS"):
        r["cpu_s_per_thread"] = {k: {n: round(x, 3) for n, x in d.items() if x > 0.002} for k, d in use.items()}
    import statistics; r["sync_med"] = statistics.median(ts); r["flat_paired"] = statistics.median(fs)
    r["ratio"] = statistics.median(f / t for f, t in zip(fs, ts))
    time.sleep(0.5)
    import threading
    import statistics
    r["cpu_flat"] = statistics.median(c for k, c in CPU if k == "flat"); r["cpu_sync"] = statistics.median(c for k, c in CPU if k == "sync")
    print(rank, r, flush=True)
    if os.environ.get("TRACE"):
        with open(os.path.join(os.environ["TRACE"], f"trace_{rank}.txt"), "w") as f:
            for t, k, n in LOG: f.write(f"{t*1e3:8.2f} {k} {n>>20}\n")
    eng.finalize()
if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    ctx = mp.get_context("spawn")
    q = [ctx.Queue(), ctx.Queue()]; qs = ctx.Queue()
    ps = [ctx.Process(target=main, args=(r, port, q, qs)) for r in range(2)]
    [p.start() for p in ps]; [p.join() for p in ps]
