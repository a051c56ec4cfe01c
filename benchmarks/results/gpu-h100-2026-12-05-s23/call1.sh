#!/usr/bin/env bash
# Session 23, device call 1: how late the host sees an interprocess event (poll / spin /
# helper thread / synchronize), then cuda_ipc's ring (4 GiB, fill programs) and zero-copy
# (1 GiB batches) with the host's event waits polled against blocked in a helper thread
# (WEIGHTSYNC_CUDA_IPC_EVENT_WAIT), settled and not, alternating, 3 rounds of 9 warm syncs.
set -u
cd "$(dirname "$0")/../../.."   # the repository root
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi -L
{ timeout 60 python3 benchmarks/event_wait_lag.py; timeout 40 python3 benchmarks/event_wait_lag.py --cap-us 20 --trials 40; } 2>&1 | tee "$OUT/event_wait_lag.txt" | grep -v "^round"
source benchmarks/gpu_rows.sh
T=90
for round in 1 2 3; do
  for st in 200 0; do
    for w in poll block; do
      rows r${round}_s${st}_$w "GPU_BENCH_SETTLE_MS=$st WEIGHTSYNC_CUDA_IPC_EVENT_WAIT=$w" --warm 9 --into-buckets 4096 --into-zero-copy-buckets 1024 --baseline-buckets "" --timeline
    done
  done
done
cd "$OUT" && tar czf s23_call1.tgz r && rm -rf r
