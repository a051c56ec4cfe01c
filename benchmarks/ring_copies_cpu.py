"""Two processes copying at once as shm's ring does (A: a big source into a 64 MiB slot; B: a
64 MiB slot into a big destination; 8 MiB pieces, ctypes.memmove, one thread each): GB/s per
copier for 1 GiB passed 4 times and 4 GiB passed once. ``.venv/bin/python benchmarks/ring_copies_cpu.py``"""
# two processes copying at once, like shm's ring: A streams a big source into a 64 MiB slot,
# B streams a 64 MiB slot into a big destination (8 MiB pieces, ctypes.memmove, 1 thread)
import ctypes, sys, time, torch, torch.multiprocessing as mp
P = 8 << 20; SLOT = 64 << 20
def run(role, total, passes, bar, q):
    torch.set_num_threads(1)
    big = torch.ones(total, dtype=torch.uint8); slot = torch.ones(SLOT, dtype=torch.uint8)
    bp, sp = big.data_ptr(), slot.data_ptr()
    bar.wait(); t = time.perf_counter()
    for _ in range(passes):
        for off in range(0, total, P):
            n = min(P, total - off); s = off % SLOT
            if role == "A": ctypes.memmove(sp + s, bp + off, n)
            else: ctypes.memmove(bp + off, sp + s, n)
    q.put((role, total * passes / (time.perf_counter() - t) / 1e9))
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    for total, passes in [(1 << 30, 4), (4 << 30, 1), (1 << 30, 4), (4 << 30, 1)]:
        bar = ctx.Barrier(2); q = ctx.Queue()
        ps = [ctx.Process(target=run, args=(r, total, passes, bar, q)) for r in "AB"]
        [p.start() for p in ps]; res = sorted([q.get(), q.get()]); [p.join() for p in ps]
        print(f"{total >> 30} GiB x {passes}: A {res[0][1]:.2f} GB/s, B {res[1][1]:.2f} GB/s", flush=True)
