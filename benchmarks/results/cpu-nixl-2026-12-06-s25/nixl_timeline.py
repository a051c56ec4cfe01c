import asyncio, os, sys, time, statistics
import torch, torch.multiprocessing as mp
sys.path.insert(0, "/work/main/src")
N = 1 << 30
def main(rank, q, qs, out):
    torch.set_num_threads(1)
    from weightsync.tools.bench.workloads import synthetic
    w = synthetic(N, "bfloat16", bucket_size=64 << 20)
    params = {n: torch.randn(s).to(torch.bfloat16) for n, s in w.tensors}
    from weightsync.transport import CheckpointEngineRegistry
    from weightsync.transport.base import worker_kwargs
    cls = CheckpointEngineRegistry.get("nixl")
    eng = cls(role="trainer" if rank == 0 else "rollout", bucket_size=64 << 20, timeout=120)
    meta = eng.prepare(); q[rank].put(meta)
    if rank == 0:
        metas = [q[0].get(), q[1].get()]
        tk, rk = cls.build_topology(1, 1, metas)
        qs.put(worker_kwargs(rk, 0)); kw = worker_kwargs(tk, 0)
    else:
        kw = qs.get()
    eng.init_process_group(**kw)
    loop = asyncio.new_event_loop()
    import cProfile
    prof = cProfile.Profile()
    async def rx(v):
        async for _ in eng.receive_into(params, version=v): pass
    res = []
    for v in range(1, 8):
        t = time.perf_counter()
        if v >= 3: prof.enable()
        if rank == 0: m = loop.run_until_complete(eng.send_weights(params.items(), version=v))
        else: m = loop.run_until_complete(rx(v))
        if v >= 3: prof.disable()
        dt = time.perf_counter() - t
        res.append((dt, (m or {}).get("stage_seconds") if rank == 0 else None, (m or {}).get("pipelined") if rank == 0 else None))
    prof.dump_stats(f"/tmp/nixl_prof_{rank}_{os.environ.get('WEIGHTSYNC_NIXL_PIPELINE','1')}.out")
    out.put((rank, res))
    eng.finalize()
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = [ctx.Queue(), ctx.Queue()]; qs = ctx.Queue(); out = ctx.Queue()
    ps = [ctx.Process(target=main, args=(r, q, qs, out)) for r in range(2)]
    [p.start() for p in ps]
    for _ in range(2):
        r, res = out.get(timeout=600)
        print(r, [(round(a, 3), b if b is None else round(b, 3), c) for a, b, c in res])
    [p.join(60) for p in ps]
