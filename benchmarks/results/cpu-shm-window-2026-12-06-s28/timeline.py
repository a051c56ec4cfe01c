"""Where one shm sync's time goes, both processes on one clock (time.perf_counter: CLOCK_MONOTONIC, shared by the
processes of a host): the bench's workloads (argv[1]: synthetic | qwen2) through a plain shm pair, receive_into, one torch
thread a process, WEIGHTSYNC_SHM_DIRECT_WINDOW as set outside. argv[2] syncs (the first is cold, not counted). argv[3]
``memcpy``: the trainer copies the workload's bytes (flat buffer to flat buffer, as the bench's paired ``memcpy`` step)
right before each sync, whose time then counts from the trainer's start (``sync_from_tx``); ``barrier``: both
processes meet at a barrier before each sync (as the bench's workers do through its parent), the receiver calling
``receive_into`` only then.

Receiver: each direct read (cma_read) and each copy out of a ring slot (_land), start and end. Trainer: each direct
header out (_direct_deliver), each wait for acknowledgements (_await_acks), each copy into a slot (_copy_piece). Printed per
warm sync (median over syncs): the sync's seconds, then what each side was busy with and the receiver's time between
direct reads that is neither a read nor a landing (its waits on the trainer)."""
import asyncio, multiprocessing as mp, os, secrets, socket, statistics, sys, time
import torch
torch.set_num_threads(1)
import weightsync
from weightsync.tools.bench.workloads import hf_qwen2, materialize, synthetic, zeros_like_spec

clock = time.perf_counter

def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def workload(kind):
    return synthetic(1 << 30, "bfloat16", bucket_size=64 << 20) if kind == "synthetic" else hf_qwen2("bfloat16")[0]

def wrap(cls, name, log, tag):
    orig = getattr(cls, name)
    def timed(self, *a, **k):
        t = clock()
        try:
            return orig(self, *a, **k)
        finally:
            log.append((tag, t, clock()))
    setattr(cls, name, timed)

def rollout(addr, kind, syncs, q, barrier=None):
    torch.set_num_threads(1)
    from weightsync.transport.backends.shm.engine import ShmEngine
    log = []
    wrap(ShmEngine, "_rx_direct", log, "read")
    wrap(ShmEngine, "_land", log, "land")
    eng = weightsync.connect("shm", role="rollout", address=addr, timeout=60)
    params = zeros_like_spec(workload(kind))
    spans = []
    async def go():
        for v in range(syncs):
            if barrier is not None:
                barrier.wait(60)
            log.clear(); t0 = clock()
            async for _ in eng.receive_into(params, version=v):
                pass
            spans.append((t0, clock(), list(log)))
    asyncio.run(go())
    q.put(spans)
    eng.finalize()

def summary(rx, tx):
    (r0, r1, rlog), (t0, t1, tlog) = rx, tx
    tot = lambda log, tag: sum(e - s for g, s, e in log if g == tag)
    reads = sorted((s, e) for g, s, e in rlog if g == "read")
    lands = sorted((s, e) for g, s, e in rlog if g == "land")
    gaps = sum(b[0] - a[1] for a, b in zip(reads, reads[1:]))
    land_in_gaps = sum(e - s for s, e in lands if reads and reads[0][0] < s < reads[-1][1])
    acks = [(s, e) for g, s, e in tlog if g == "acks"]
    return {"sync": max(r1, t1) - min(r0, t0), "sync_from_tx": max(r1, t1) - t0, "rx": r1 - r0, "tx": t1 - t0,
            "reads": tot(rlog, "read"), "n_reads": len(reads), "lands": tot(rlog, "land"), "n_lands": len(lands),
            "rx_gaps_between_reads": gaps, "lands_between_reads": land_in_gaps,
            "rx_before_first_read": (reads[0][0] - r0) if reads else 0.0,
            "rx_after_last_read": (r1 - reads[-1][1]) if reads else 0.0,
            "tx_pack": tot(tlog, "pack"), "tx_wait_acks": tot(tlog, "acks"), "n_acks": len(acks),
            "tx_headers": len([1 for g, *_ in tlog if g == "direct"])}

def main():
    kind, syncs = sys.argv[1], int(sys.argv[2])
    from weightsync.transport.backends.shm.engine import ShmEngine
    from weightsync.transport.protocol.sender import BucketedEngine
    log = []
    wrap(ShmEngine, "_direct_deliver", log, "direct")
    wrap(ShmEngine, "_await_acks", log, "acks")
    orig = BucketedEngine._copy_piece        # a staticmethod: wrap the function
    def pack(buf, meta, tensor, dtype):
        t = clock()
        try:
            return orig(buf, meta, tensor, dtype)
        finally:
            log.append(("pack", t, clock()))
    BucketedEngine._copy_piece = staticmethod(pack)
    addr = f"127.0.0.1:{port()}"
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    barrier = ctx.Barrier(2) if "barrier" in sys.argv[3:] else None
    p = ctx.Process(target=rollout, args=(addr, kind, syncs, q, barrier)); p.start()
    eng = weightsync.connect("shm", role="trainer", address=addr, timeout=60)
    params = list(materialize(workload(kind)).items())
    flat = None
    if "memcpy" in sys.argv[3:]:
        n = sum(t.numel() * t.element_size() for _, t in params)
        flat = (torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8))
    spans, unwaited = [], []
    async def go():
        for v in range(syncs):
            if flat is not None:
                flat[1].copy_(flat[0])
            if barrier is not None:
                barrier.wait(60)
            log.clear(); t0 = clock()
            rep = await eng.send_weights(params, version=v)
            spans.append((t0, clock(), list(log)))
            unwaited.append(rep.get("direct_unwaited"))
    asyncio.run(go())
    rx = q.get(timeout=300); p.join(30); eng.finalize()
    rows = [summary(a, b) for a, b in zip(rx[1:], spans[1:])]
    window = os.environ.get("WEIGHTSYNC_SHM_DIRECT_WINDOW", "2")
    print(f"{kind} window {window}{', a memcpy before each sync' if flat is not None else ''}{', a barrier before each sync' if barrier is not None else ''}, {len(rows)} warm syncs, median ms; direct tensors not waited for, per sync: {unwaited}")
    for k in rows[0]:
        vals = [r[k] for r in rows]
        med = statistics.median(vals)
        print(f"  {k:24s} {med * 1e3 if not k.startswith('n_') and k != 'tx_headers' else med:9.1f}")

if __name__ == "__main__":
    os.environ.setdefault("WEIGHTSYNC_TOKEN", secrets.token_hex(8))
    main()
