"""Raw process_vm_readv (weightsync.transport.fastcopy.cma_read, argv[2] threads, default 1) of 1 GiB in reads of S bytes, out of one
trainer-side buffer (separate tensors of S bytes, as a model's parameters are) into receiver tensors of the same sizes
(receive_into's destinations), warm median of 7 passes: does a read's rate depend on its size, with no engine around it?"""
import multiprocessing as mp, os, statistics, sys, time
import torch

SIZES = [int(float(s) * 2**20) for s in (sys.argv[1].split(",") if len(sys.argv) > 1 else "1,2,4,8,16,64,128".split(","))]
PARTS = int(sys.argv[2]) if len(sys.argv) > 2 else 1     # reads of >= 8 MiB split over PARTS threads, as shm's receivers do
TOTAL = 1 << 30

def owner(q, ready, done):
    bufs = {s: [torch.ones(s, dtype=torch.uint8) for _ in range(TOTAL // s)] for s in SIZES}
    q.put((os.getpid(), {s: [b.data_ptr() for b in v] for s, v in bufs.items()}))
    done.wait()

def main():
    from concurrent.futures import ThreadPoolExecutor
    from weightsync.transport.fastcopy import cma_read
    pool = ThreadPoolExecutor(PARTS - 1) if PARTS > 1 else None
    ctx = mp.get_context("spawn"); q = ctx.Queue(); done = ctx.Event()
    p = ctx.Process(target=owner, args=(q, None, done)); p.start()
    pid, addrs = q.get(timeout=120)
    for s in SIZES:
        dst = [torch.zeros(s, dtype=torch.uint8) for _ in range(TOTAL // s)]
        times = []
        for _ in range(8):
            t = time.perf_counter()
            for a, d in zip(addrs[s], dst):
                cma_read(pid, a, d, pool, PARTS)
            times.append(time.perf_counter() - t)
        w = statistics.median(times[1:])
        print(f"{s >> 20:4d} MiB x {TOTAL // s:5d}: {w * 1e3:6.1f} ms, {TOTAL / w / 1e9:5.2f} GB/s, {w / (TOTAL // s) * 1e6:7.1f} us/read", flush=True)
        del dst
    done.set(); p.join(30)

if __name__ == "__main__":
    main()
