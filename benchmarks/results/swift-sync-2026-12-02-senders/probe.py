import sys, time
sys.path.insert(0, "src")
from weightsync.integrations.swift_harness import SwiftCluster
from weightsync.testing.toymodel import tiny_qwen2_config
c = SwiftCluster("shm", bucket_size=64 << 20, config=tiny_qwen2_config(hidden_size=256, layers=4))
try:
    for senders in ("all", "master", "all"):
        c.use_backend("shm", bucket_size=64 << 20, senders=senders)
        c.build(None)
        m = c.manager()
        for i in range(12):
            t = time.perf_counter(); m.sync_weights(merge_and_sync=True); took = time.perf_counter() - t
            if i >= 2 and i % 3 == 0:
                st = c.stats()
                print(senders, f"{took*1e3:.1f}ms", [(f"{s['check_s']*1e3:.1f}", f"{s['send_s']*1e3:.1f}", s['sent_bytes']) for s in st[:2]], flush=True)
finally:
    c.shutdown()
