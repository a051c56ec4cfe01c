import os, time, torch, multiprocessing as mp
from concurrent.futures import ThreadPoolExecutor
from weightsync.transport.fastcopy import cma_read, memmove_at
N = 1 << 30
def child(q, ev):
    torch.set_num_threads(1)
    t = torch.ones(N, dtype=torch.uint8)
    q.put((os.getpid(), t.data_ptr())); ev.wait()
if __name__ == "__main__":
    ctx = mp.get_context("spawn"); q = ctx.Queue(); ev = ctx.Event()
    p = ctx.Process(target=child, args=(q, ev)); p.start()
    pid, addr = q.get()
    torch.set_num_threads(1)
    dst = torch.zeros(N, dtype=torch.uint8); src = torch.ones(N, dtype=torch.uint8)
    pool = ThreadPoolExecutor(1)
    def tm(f, k=5):
        ts = []
        for _ in range(k):
            t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
        return sorted(ts)[k // 2]
    print("copy_ 1 thread", tm(lambda: dst.copy_(src)))
    torch.set_num_threads(2); print("copy_ 2 threads", tm(lambda: dst.copy_(src))); torch.set_num_threads(1)
    print("memmove", tm(lambda: memmove_at(dst, 0, src, N)))
    print("cma 1 thread", tm(lambda: cma_read(pid, addr, dst)))
    print("cma 2 threads", tm(lambda: cma_read(pid, addr, dst, pool, 2)))
    # 16 MiB chunks, serially
    C = 16 << 20
    def chunks(parts):
        for off in range(0, N, C):
            cma_read(pid, addr + off, dst[off:off + C], pool, parts)
    print("cma 16MiB pieces 1 thread", tm(lambda: chunks(1)))
    print("cma 16MiB pieces 2 threads", tm(lambda: chunks(2)))
    ev.set(); p.join()
