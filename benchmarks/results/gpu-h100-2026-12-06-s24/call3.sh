#!/usr/bin/env bash
# Session 24, the last device call the time allows (after seven refused starts): the push
# GPU tests, then zero-copy (1 GiB batches) against pushes (--into-push-buckets 4096),
# settled (200 ms), 9 warm syncs, 16.06 GB bf16 into the caller's tensors; unsettled too
# if the time allows.
set -u
cd "$(dirname "$0")/../../.."   # the repository root
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_CPP_LOG_LEVEL=ERROR
nvidia-smi -L | tee "$OUT/gpu.txt"
timeout 80 python3 -m pytest -v -p no:cacheprovider -rfE -m gpu tests/test_gpu_cuda_ipc.py \
  -k "push" 2>&1 | tee "$OUT/gpu_tests_push.txt" | tail -15
source benchmarks/gpu_rows.sh
T=75
for st in 200 0; do
  [ "$st" = 0 ] && [ "$SECONDS" -ge 140 ] && break
  rows r1_s$st "GPU_BENCH_SETTLE_MS=$st" --warm 9 --into-buckets "" --into-zero-copy-buckets 1024 --into-push-buckets 4096 --baseline-buckets "" --timeline
  (cd "$OUT" && tar czf s24_call3.tgz r)
done
echo "elapsed $SECONDS s"
