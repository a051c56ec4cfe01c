#!/usr/bin/env bash
# Session 24, device call 1 trimmed further (device time left after five refused starts):
# the push GPU tests, then zero-copy (1 GiB batches) against pushes (--into-push-buckets
# 4096: held writes in batches of 512 MiB), settled (200 ms) and not, 9 warm syncs, 16.06 GB
# bf16 into the caller's tensors; the 3 reruns and the race checks if the time allows.
set -u
cd "$(dirname "$0")/../../.."   # the repository root
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_CPP_LOG_LEVEL=ERROR
nvidia-smi -L | tee "$OUT/gpu.txt"
timeout 90 python3 -m pytest -v -p no:cacheprovider -rfE -m gpu tests/test_gpu_cuda_ipc.py \
  -k "push" 2>&1 | tee "$OUT/gpu_tests_push.txt" | tail -15
source benchmarks/gpu_rows.sh
T=80
for st in 200 0; do
  rows r1_s$st "GPU_BENCH_SETTLE_MS=$st" --warm 9 --into-buckets "" --into-zero-copy-buckets 1024 --into-push-buckets 4096 --baseline-buckets "" --timeline
  (cd "$OUT" && tar czf s24_call2.tgz r)
done
echo "elapsed $SECONDS s"
if [ "$SECONDS" -lt 200 ]; then
  timeout 100 python3 -m pytest -v -p no:cacheprovider -rfE -m gpu tests/test_gpu_cuda_ipc.py \
    -k "(test_one_trainer_many_receivers or test_two_trainers or race_checks) and not push" 2>&1 \
    | tee "$OUT/gpu_tests_rest.txt" | tail -15
fi
echo "elapsed $SECONDS s"
