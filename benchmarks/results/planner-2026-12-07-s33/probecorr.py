"""Session 33: each bench's CPU-speed probe (hostload.txt C lines: a fixed Python loop, 20k small
torch ops, time.sleep(100 us) percentiles) against its 256 MiB event ring median, as a share
of that code's median over the machine's runs. Run in gpu-h100-2026-12-07-s33/."""
import collections, json, statistics
probe = {}
for line in open("hostload.txt"):
    if line.startswith("C "):
        f = line.split(); probe[f[3]] = (float(f[4]), float(f[5]), int(f[7]))
by = collections.defaultdict(list)
for name, (loop, ops, nap) in probe.items():
    code = next(p for p in name.split("/") if p in ("c1129", "c1201", "now"))
    for e in json.load(open(f"{name}/gpu_bench.json"))["engine"]:
        c = e["cfg"]
        if c["bucket_size"] == 256 << 20 and c["sync"] == "event" and not c.get("zero_copy") \
                and c.get("consume", "copy") in ("copy", "into") and set(c) <= {"bucket_size", "num_slots", "zero_copy", "sync", "consume"}:
            by[code].append((name, loop, ops, nap, e["median_ms"]))
xs, ys = [], []
for code, rs in by.items():
    med = statistics.median(r[4] for r in rs)
    for name, loop, ops, nap, ms in rs:
        print(f"{name:12s} loop {loop:.3f} s, ops {ops:.3f} s, sleep(100us) median {nap} us; 256 MiB {ms:.1f} ms ({ms / med:.2f} x the code's median)")
        xs.append(loop); ys.append(ms / med)
n = len(xs); mx, my = sum(xs) / n, sum(ys) / n
r = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / (sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys)) ** 0.5
print(f"Pearson r (loop time vs share of the code's median), n={n}: {r:.2f}")
