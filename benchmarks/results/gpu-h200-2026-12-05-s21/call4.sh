#!/usr/bin/env bash
# Session 21, device call 4: batched fill programs against the plain ring, 4 GiB, settled
# and not, two rounds of 11 warm syncs; then the race tests call 3 did not reach (the
# fill-program mutant among them), fill_graphs on wherever a test leaves it to the environment.
set -u
cd "$(dirname "$0")/../../.."
source benchmarks/gpu_rows.sh   # (these helpers were inline in the script that ran)
for round in 1 2; do
  for st in 0 200; do
    rows r${round}_settle$st GPU_BENCH_SETTLE_MS=$st --warm 11 --into-buckets 4096 --into-zero-copy-buckets "" --into-fill-graphs-buckets 4096 --baseline-buckets "" --timeline
  done
done
WEIGHTSYNC_CUDA_IPC_FILL_GRAPHS=1 timeout 240 python3 -m pytest -v -p no:cacheprovider -rfE -m gpu tests/test_gpu_cuda_ipc.py -k "race_checks or graphed_copies or fill" 2>&1 | tee $R/gpu_tests_cuda_ipc.txt | tail -4
cd $OUT && tar czf s21_call4.tgz r && rm -rf r
