"""Per-direct-tensor cost of shm: N tensors of S bytes, all direct, receive_into."""
import asyncio, multiprocessing as mp, os, secrets, socket, sys, time, statistics
import torch
torch.set_num_threads(1)
import weightsync

def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def rollout(addr, n, size, syncs, q, prof):
    torch.set_num_threads(1)
    eng = weightsync.connect("shm", role="rollout", address=addr, timeout=60)
    params = {f"t{i}": torch.empty(size // 2, dtype=torch.bfloat16) for i in range(n)}
    async def go():
        for v in range(syncs):
            async for _ in eng.receive_into(params, version=v):
                pass
    if prof == "time":
        import weightsync.transport.backends.shm.engine as E
        from weightsync.transport.protocol import receiver as RM
        acc = {"cma": 0.0, "pump_direct": 0.0, "n": 0, "pop": 0.0}
        orig = E.cma_read
        def timed(*a, **k):
            t = time.perf_counter(); r = orig(*a, **k); acc["cma"] += time.perf_counter() - t; acc["n"] += 1; return r
        E.cma_read = timed
        od = RM.ReceiverMixin._rx_direct_pump
        def tdp(self, *a, **k):
            t = time.perf_counter(); r = od(self, *a, **k); acc["pump_direct"] += time.perf_counter() - t; return r
        RM.ReceiverMixin._rx_direct_pump = tdp
        t0 = time.perf_counter(); asyncio.run(go()); tot = time.perf_counter() - t0
        q.put(f"receiver total {tot*1e3:.0f} ms over {syncs} syncs; cma_read {acc['cma']*1e3:.0f} ms ({acc['n']} reads), _rx_direct_pump {acc['pump_direct']*1e3:.0f} ms")
    elif prof:
        import cProfile, pstats, io
        pr = cProfile.Profile(); pr.enable(); asyncio.run(go()); pr.disable()
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15); q.put(s.getvalue())
    else:
        asyncio.run(go()); q.put("")
    eng.finalize()

def main():
    n, size, syncs = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    prof = sys.argv[4] if len(sys.argv) > 4 else ''
    addr = f"127.0.0.1:{port()}"
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    p = ctx.Process(target=rollout, args=(addr, n, size, syncs, q, prof)); p.start()
    eng = weightsync.connect("shm", role="trainer", address=addr, timeout=60)
    params = [(f"t{i}", torch.randn(size // 2).to(torch.bfloat16)) for i in range(n)]
    times = []
    async def go():
        for v in range(syncs):
            t0 = time.perf_counter(); await eng.send_weights(params, version=v); times.append(time.perf_counter() - t0)
    asyncio.run(go())
    out = q.get(timeout=120); p.join(30); eng.finalize()
    w = statistics.median(times[1:])
    print(f"n={n} size={size>>20}MiB total={n*size/1e9:.2f}GB warm median {w*1e3:.1f} ms, {w/n*1e6:.0f} us/tensor, {n*size/w/1e9:.2f} GB/s")
    if out: print(out)

if __name__ == "__main__":
    os.environ.setdefault("WEIGHTSYNC_TOKEN", secrets.token_hex(8))
    main()
