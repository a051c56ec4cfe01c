#!/usr/bin/env bash
# Session 23, device call 4 (trimmed to the device time left after refused starts): the
# push GPU tests (race checks with and without the waits) first, then zero-copy (1 GiB
# batches) against pushes (--into-push-buckets 4096: held writes in batches of 512 MiB),
# settled (200 ms) and not, 9 warm syncs, as many rounds as the time allows.
set -u
cd "$(dirname "$0")/../../.."   # the repository root
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_CPP_LOG_LEVEL=ERROR
nvidia-smi -L | tee "$OUT/gpu.txt"
timeout 90 python3 -m pytest -v -p no:cacheprovider -rfE -m gpu tests/test_gpu_cuda_ipc.py \
  -k "push" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -12
source benchmarks/gpu_rows.sh
T=50
for round in 1 2; do
  for st in 200 0; do
    rows r${round}_s$st "GPU_BENCH_SETTLE_MS=$st" --warm 9 --into-buckets "" --into-zero-copy-buckets 1024 --into-push-buckets 4096 --baseline-buckets "" --timeline
    (cd "$OUT" && tar czf s23_call4.tgz r)
  done
done
