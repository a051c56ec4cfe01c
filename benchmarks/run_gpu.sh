#!/usr/bin/env bash
# One device call: the cuda_ipc benchmark, then the GPU tests. Everything lands in $OUT.
#   OUT=/tmp/out bash benchmarks/run_gpu.sh [gpu_bench.py options]
set -u -o pipefail
OUT=${OUT:-/tmp/weightsync-gpu}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_CPP_LOG_LEVEL=ERROR
PY=${PY:-python3}
{ date -u; nvidia-smi; $PY -c 'import torch; print("torch", torch.__version__, "cuda",
  torch.version.cuda, torch.cuda.get_device_name(0))'; } > "$OUT/env.txt" 2>&1
head -20 "$OUT/env.txt"
timeout "${BENCH_TIMEOUT:-240}" $PY benchmarks/gpu_bench.py --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/gpu_bench.txt" | tail -30
echo "bench exit ${PIPESTATUS[0]}"
timeout "${TEST_TIMEOUT:-330}" $PY -m pytest -v -p no:cacheprovider -rfE \
  tests/test_gpu_cuda_ipc.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -45
echo "tests exit ${PIPESTATUS[0]}"
