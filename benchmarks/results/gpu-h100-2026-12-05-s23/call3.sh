#!/usr/bin/env bash
# Session 23, device call 3 (tree: the helper-thread waits reverted, cuda_ipc pushes added):
# the GPU tests of cuda_ipc that call 2 failed on the helper thread it left behind, the
# push tests and every race check; then zero-copy (1 GiB batches) against pushes (held
# writes in batches of 512 MiB and of 128 MiB: --into-push-buckets 4096 / 1024) and the
# ring (4 GiB), settled (200 ms) and not, two rounds of 9 warm syncs.
set -u
cd "$(dirname "$0")/../../.."   # the repository root
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_CPP_LOG_LEVEL=ERROR
nvidia-smi -L | tee "$OUT/gpu.txt"
source benchmarks/gpu_rows.sh
T=120
for round in 1 2; do
  for st in 200 0; do
    rows r${round}_s$st "GPU_BENCH_SETTLE_MS=$st" --warm 9 --into-buckets 4096 --into-zero-copy-buckets 1024 --into-push-buckets 4096,1024 --baseline-buckets "" --timeline
  done
done
cd "$OUT" && tar czf s23_call3.tgz r && rm -rf r && cd - >/dev/null
timeout 300 python3 -m pytest -v -p no:cacheprovider -rfE -m gpu tests/test_gpu_cuda_ipc.py \
  -k "test_one_trainer_many_receivers or test_two_trainers or race_checks or pushes" 2>&1 \
  | tee "$OUT/gpu_tests.txt" | tail -30
