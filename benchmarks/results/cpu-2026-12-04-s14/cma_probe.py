import multiprocessing as mp, time, statistics, os, sys
import torch
from concurrent.futures import ThreadPoolExecutor
from weightsync.transport.fastcopy import cma_read

def child(q, ev):
    t = torch.randn(1 << 28)  # 1 GiB fp32
    q.put((os.getpid(), t.data_ptr())); ev.wait(120)

if __name__ == "__main__":
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn"); q = ctx.Queue(); ev = ctx.Event()
    p = ctx.Process(target=child, args=(q, ev)); p.start()
    pid, addr = q.get()
    dst = torch.empty(1 << 30, dtype=torch.uint8); dst.fill_(1)
    pool = ThreadPoolExecutor(1)
    for size in (2 << 20, 16 << 20, 128 << 20, 1 << 30):
        for parts in (1, 2):
            ts = []
            for rep in range(5):
                t0 = time.perf_counter()
                for off in range(0, 1 << 30, size):
                    cma_read(pid, addr + off, dst[off: off + size], pool if parts > 1 else None, parts)
                ts.append(time.perf_counter() - t0)
            m = statistics.median(ts)
            print(f"chunk {size>>20:5d} MiB parts {parts}: {m*1e3:6.1f} ms  {(1<<30)/m/1e9:5.2f} GB/s")
    t0 = time.perf_counter(); ts=[]
    src = torch.empty(1 << 30, dtype=torch.uint8).fill_(2)
    for rep in range(5):
        t0 = time.perf_counter(); dst.copy_(src); ts.append(time.perf_counter()-t0)
    print(f"memcpy 1 GiB one thread: {statistics.median(ts)*1e3:.1f} ms")
    ev.set(); p.join()
