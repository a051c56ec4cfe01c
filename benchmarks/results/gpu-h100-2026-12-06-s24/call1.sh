#!/usr/bin/env bash
# Session 24, device call 1 (tree: session 23's end, cuda_ipc pushes never yet run on a GPU):
# 1. the push GPU tests (slow streams, race checks with and without the waits);
# 2. zero-copy (1 GiB batches) against pushes (held writes in batches of 512 MiB and of
#    128 MiB: --into-push-buckets 4096,1024) and the ring (4 GiB), settled (200 ms) and
#    not, 9 warm syncs, 16.06 GB bf16 into the caller's tensors;
# 3. the 3 tests that session 23's call 2 failed on the reverted helper thread, + all
#    race checks; 4. a second round of rows if the time allows.
set -u
cd "$(dirname "$0")/../../.."   # the repository root
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_CPP_LOG_LEVEL=ERROR
nvidia-smi -L | tee "$OUT/gpu.txt"
timeout 100 python3 -m pytest -v -p no:cacheprovider -rfE -m gpu tests/test_gpu_cuda_ipc.py \
  -k "push" 2>&1 | tee "$OUT/gpu_tests_push.txt" | tail -15
source benchmarks/gpu_rows.sh
T=100
round() {
  for st in 200 0; do
    rows r$1_s$st "GPU_BENCH_SETTLE_MS=$st" --warm 9 --into-buckets 4096 --into-zero-copy-buckets 1024 --into-push-buckets 4096,1024 --baseline-buckets "" --timeline
    (cd "$OUT" && tar czf s24_call1.tgz r)
  done
}
round 1
timeout 120 python3 -m pytest -v -p no:cacheprovider -rfE -m gpu tests/test_gpu_cuda_ipc.py \
  -k "(test_one_trainer_many_receivers or test_two_trainers or race_checks) and not push" 2>&1 \
  | tee "$OUT/gpu_tests_rest.txt" | tail -15
echo "elapsed $SECONDS s"
if [ "$SECONDS" -lt 280 ]; then round 2; fi
echo "elapsed $SECONDS s"
