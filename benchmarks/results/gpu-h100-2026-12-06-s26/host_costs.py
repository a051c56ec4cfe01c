"""The trainer's host costs in the --timeline runs of this folder (one warm sync, ring 1 GiB buckets, event): the time
between the end of each wait for a free slot and the next publish (packing that bucket's tensors), per tensor (291), and
each publish's duration. Session 28."""
import re, sys

for f in ("call1/c1129", "call2/c1129", "call2/c1201"):
    ev = []
    for line in open(f"{f}/timeline/gpu_bench.txt"):
        m = re.match(r"\s+([\d.]+) ms\s+(T|R) (<?)(\w+)(>?)", line)
        if m and m.group(2) == "T":
            ev.append((float(m.group(1)), m.group(3) == "<", m.group(4)))
    pack, pub, free, start = [], [], None, None
    for t, end, name in ev:
        if name == "_tx_wait_free" and end:
            free = t
        elif name == "_publish" and not end:
            if free is not None:
                pack.append(t - free)
                free = None
            start = t
        elif name == "_publish" and end and start is not None:
            pub.append(t - start)
            start = None
    sync = max(t for t, end, name in ev if name == "send_weights" and end)
    print(f"{f}: {len(pub)} buckets, packing {sum(pack):.2f} ms = {sum(pack) / 291 * 1e3:.1f} us a tensor, "
          f"publish {min(pub):.2f}-{max(pub):.2f} ms (mean {sum(pub) / len(pub):.3f}), send_weights {sync:.2f} ms")
