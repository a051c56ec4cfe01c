#!/usr/bin/env bash
# Session 21, device call 3: fill_graphs in batches (an eighth of a bucket) against the
# plain ring, settled and not, two rounds; then the cuda_ipc GPU tests with fill_graphs on
# wherever a test leaves it to the environment.
set -u
cd "$(dirname "$0")/../../.."
source benchmarks/gpu_rows.sh   # (these helpers were inline in the script that ran)
for round in 1 2; do
  for st in 0 200; do
    rows r${round}_settle$st GPU_BENCH_SETTLE_MS=$st --warm 7 --into-buckets 4096 --into-zero-copy-buckets "" --into-fill-graphs-buckets 2048,4096 --baseline-buckets "" --timeline
  done
done
WEIGHTSYNC_CUDA_IPC_FILL_GRAPHS=1 timeout 330 python3 -m pytest -v -p no:cacheprovider -rfE -m gpu tests/test_gpu_cuda_ipc.py 2>&1 | tee $R/gpu_tests_cuda_ipc.txt | tail -4
cd $OUT && tar czf s21_call3.tgz r && rm -rf r
