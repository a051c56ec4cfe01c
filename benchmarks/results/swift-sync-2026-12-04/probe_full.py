import sys, time, statistics as st
sys.path.insert(0, "src")
from weightsync.integrations.swift_harness import SwiftCluster
c = SwiftCluster("shm", bucket_size=64 << 20)
try:
    c.build(None)
    c.use_backend("shm", bucket_size=64 << 20)
    m = c.manager()
    rows = []
    for i in range(25):
        t = time.perf_counter(); m.sync_weights(); took = time.perf_counter() - t
        if i >= 3:
            s = c.stats()
            rows.append([took] + [s[0].get(k, 0) for k in ("join_s", "check_s", "send_s")] + [c._all("state", c.rollouts)[0]["last"]["seconds"]])
    for j, n in enumerate(["total", "t0 join", "t0 check(join+ready)", "t0 send", "r0 load_weights"]):
        print(f"{n:24} median {1e3*st.median(r[j] for r in rows):7.2f} ms")
finally:
    c.shutdown()
