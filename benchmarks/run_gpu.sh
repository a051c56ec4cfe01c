#!/usr/bin/env bash
# One call on a GPU machine: the codec's GPU tests, gpu_bench.py (a small run, then the
# 8B-shaped one), then the other GPU tests. Everything lands in $OUT (at most 8 files).
#   OUT=/tmp/out bash benchmarks/run_gpu.sh [gpu_bench.py options for the full run]
# SKIP_SMOKE=1 / SKIP_BENCH=1 / SKIP_TESTS=1 skip the small run / the full run / the tests
# after it; EXTRA=1 also runs shm_d2h.py and, where nixl imports, nixl_gpu.py.
set -u -o pipefail
OUT=${OUT:-/tmp/weightsync-gpu}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_CPP_LOG_LEVEL=ERROR
PY=${PY:-python3}
{ date -u; nvidia-smi; $PY -c 'import torch, triton; print("torch", torch.__version__, "cuda",
  torch.version.cuda, torch.cuda.get_device_name(0), "triton", triton.__version__)'; } \
  > "$OUT/env.txt" 2>&1
tail -3 "$OUT/env.txt"
timeout "${CODEC_TIMEOUT:-240}" $PY -m pytest -q -p no:cacheprovider -rfE -m gpu \
  tests/test_gpu_codec.py 2>&1 | tee "$OUT/tests_codec.txt" | tail -15
echo "codec tests exit ${PIPESTATUS[0]}"
if [ -z "${SKIP_SMOKE:-}" ]; then
  mkdir -p "$OUT/smoke"
  timeout "${SMOKE_TIMEOUT:-120}" $PY benchmarks/gpu_bench.py --scale 8 --layers 2 --warm 2 \
    --out "$OUT/smoke" 2>&1 | tee "$OUT/smoke/gpu_bench.txt" | tail -9
  echo "smoke bench exit ${PIPESTATUS[0]}"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-420}" $PY benchmarks/gpu_bench.py --out "$OUT" "$@" 2>&1 \
    | tee "$OUT/gpu_bench.txt" | tail -9
  echo "bench exit ${PIPESTATUS[0]}"
fi
if [ -n "${EXTRA:-}" ]; then
  timeout 150 $PY benchmarks/shm_d2h.py --out "$OUT" 2>&1 | tail -3
  if $PY -c 'import nixl' 2>/dev/null; then
    timeout 150 $PY benchmarks/nixl_gpu.py --gib 1 --warm 3 --out "$OUT" 2>&1 | tail -5
  fi
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -q -p no:cacheprovider -rfE -m gpu \
    tests/test_gpu_cuda_ipc.py tests/test_cuda_ipc.py tests/test_gpu_checksum_order.py \
    tests/test_gpu_shm.py 2>&1 | tee "$OUT/tests_gpu.txt" | tail -15
  echo "gpu tests exit ${PIPESTATUS[0]}"
fi
