"""The bench's synthetic 1 GiB workload through an shm engine pair (receive_into, 1 torch thread), with the
receiver's cma_read and direct pump timed: where a sync's time goes beside the direct reads."""
import asyncio, multiprocessing as mp, os, secrets, socket, sys, time, statistics
import torch
torch.set_num_threads(1)
import weightsync
from weightsync.tools.bench.workloads import synthetic, materialize, zeros_like_spec

def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def rollout(addr, syncs, q, nbytes):
    torch.set_num_threads(1)
    eng = weightsync.connect("shm", role="rollout", address=addr, timeout=60)
    w = synthetic(nbytes, "bfloat16", bucket_size=64 << 20)
    params = zeros_like_spec(w)
    import weightsync.transport.backends.shm.engine as E
    from weightsync.transport.protocol import receiver as RM
    acc = {"cma": 0.0, "n": 0, "pump": 0.0, "sync": []}
    orig = E.cma_read
    def timed(*a, **k):
        t = time.perf_counter(); r = orig(*a, **k); acc["cma"] += time.perf_counter() - t; acc["n"] += 1; return r
    E.cma_read = timed
    od = RM.ReceiverMixin._rx_direct_pump
    def tdp(self, *a, **k):
        t = time.perf_counter(); r = od(self, *a, **k); acc["pump"] += time.perf_counter() - t; return r
    RM.ReceiverMixin._rx_direct_pump = tdp
    async def go():
        for v in range(syncs):
            t0 = time.perf_counter()
            async for _ in eng.receive_into(params, version=v):
                pass
            acc["sync"].append(time.perf_counter() - t0)
    asyncio.run(go())
    q.put(f"receiver: cma_read {acc['cma']/syncs*1e3:.1f} ms/sync ({acc['n']//syncs} reads), direct pump {acc['pump']/syncs*1e3:.1f} ms/sync, receive {statistics.median(acc['sync'][1:])*1e3:.1f} ms")
    eng.finalize()

def main():
    syncs = int(sys.argv[1]); nbytes = int(float(sys.argv[2]) * 2**30)
    addr = f"127.0.0.1:{port()}"
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    p = ctx.Process(target=rollout, args=(addr, syncs, q, nbytes)); p.start()
    eng = weightsync.connect("shm", role="trainer", address=addr, timeout=60)
    w = synthetic(nbytes, "bfloat16", bucket_size=64 << 20)
    params = list(materialize(w).items())
    times = []
    async def go():
        for v in range(syncs):
            t0 = time.perf_counter(); await eng.send_weights(params, version=v); times.append(time.perf_counter() - t0)
    asyncio.run(go())
    out = q.get(timeout=120); p.join(30); eng.finalize()
    print(f"trainer send warm median {statistics.median(times[1:])*1e3:.1f} ms; {out}")

if __name__ == "__main__":
    os.environ.setdefault("WEIGHTSYNC_TOKEN", secrets.token_hex(8))
    main()
