"""How long an shm receiver waits between two direct reads, in any code of the project (the
11-29 ``weightsync.engines`` layout or today's ``weightsync.transport``): the Qwen2-0.5B
workload (bf16) through a plain shm pair, ``receive_into``, one torch thread a process, the
code on PYTHONPATH and its ``WEIGHTSYNC_SHM_*`` settings as set outside. The receiver's
direct reads (``_rx_direct``, the cross-memory read) are timed, start and end, on the clock
both processes share (time.perf_counter: CLOCK_MONOTONIC). argv[1]: syncs (the first, cold,
not counted). Prints one JSON line: per warm sync, the sync's seconds, the number of reads,
their seconds, and the receiver's time between the first read's start and the last read's
end that is not a read (its waits on the trainer between reads), then their medians."""
import asyncio, json, multiprocessing as mp, os, secrets, socket, statistics, sys, time
import torch

clock = time.perf_counter


def _modules():
    try:                                   # today's layout
        from weightsync.transport.backends.shm.engine import ShmEngine
        from weightsync.tools.bench.workloads import hf_qwen2, materialize, zeros_like_spec
    except ImportError:                    # the 11-29 layout
        from weightsync.engines.shm import ShmEngine
        from weightsync.bench.workloads import hf_qwen2, materialize, zeros_like_spec
    return ShmEngine, hf_qwen2, materialize, zeros_like_spec


def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def rollout(addr, syncs, q):
    torch.set_num_threads(1)
    import weightsync
    ShmEngine, hf_qwen2, _, zeros_like_spec = _modules()
    log = []
    orig = ShmEngine._rx_direct

    def timed(self, *a, **k):
        t = clock()
        try:
            return orig(self, *a, **k)
        finally:
            log.append((t, clock()))
    ShmEngine._rx_direct = timed
    eng = weightsync.connect("shm", role="rollout", address=addr, timeout=60)
    params = zeros_like_spec(hf_qwen2("bfloat16")[0])
    out = []

    async def go():
        for v in range(syncs):
            log.clear(); t0 = clock()
            async for _ in eng.receive_into(params, version=v):
                pass
            t1 = clock()
            reads = sorted(log)
            gaps = sum(b[0] - a[1] for a, b in zip(reads, reads[1:]))
            out.append({"sync_s": t1 - t0, "n_reads": len(reads),
                        "reads_s": sum(e - s for s, e in reads), "gaps_s": gaps})
    asyncio.run(go())
    q.put(out)
    eng.finalize()


def main():
    torch.set_num_threads(1)
    import weightsync
    _, hf_qwen2, materialize, _ = _modules()
    syncs = int(sys.argv[1])
    addr = f"127.0.0.1:{port()}"
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    p = ctx.Process(target=rollout, args=(addr, syncs, q)); p.start()
    eng = weightsync.connect("shm", role="trainer", address=addr, timeout=60)
    params = list(materialize(hf_qwen2("bfloat16")[0]).items())

    async def go():
        for v in range(syncs):
            await eng.send_weights(params, version=v)
    asyncio.run(go())
    rows = q.get(timeout=300)[1:]
    p.join(30); eng.finalize()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["gap_per_read_us"] = med["gaps_s"] / max(med["n_reads"] - 1, 1) * 1e6
    print(json.dumps({"code": os.environ.get("CODE", "?"),
                      "env": {k: v for k, v in os.environ.items() if k.startswith("WEIGHTSYNC_SHM")},
                      "median": med, "syncs": rows}))


if __name__ == "__main__":
    os.environ.setdefault("WEIGHTSYNC_TOKEN", secrets.token_hex(8))
    main()
