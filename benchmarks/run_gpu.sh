#!/usr/bin/env bash
# One device call: the cuda_ipc benchmark, GPU trainer -> shm -> CPU (shm_d2h.py), the nixl
# VRAM benchmark, then the GPU tests.
# Everything lands in $OUT.
#   OUT=/tmp/out bash benchmarks/run_gpu.sh [gpu_bench.py options]
# SKIP_BENCH=1 / SKIP_D2H=1 / SKIP_NIXL_BENCH=1 skip the cuda_ipc / shm D2H / nixl benchmarks; on 2+ GPUs the nixl
# benchmark runs again with the trainer on GPU 0 and the receiver on GPU 1.
# NIXL: carry .wheels-device (nixl + nixl-cu13 wheels, see BENCHMARKS.md); without it the
# nixl steps are skipped. The whole nixl_cu13 wheel (59 MB) no longer fits the 64 MiB a call
# carries beside the tree: unzip it, delete nixl_ep_cu13/ and
# nixl_cu13.libs/ucx/libucx_perftest_cuda.so.0.0.0 (and their RECORD lines), zip it again
# (28 MB); weightsync uses neither.
set -u -o pipefail
OUT=${OUT:-/tmp/weightsync-gpu}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_CPP_LOG_LEVEL=ERROR
PY=${PY:-python3}
if ls .wheels-device/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels-device/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
{ date -u; nvidia-smi; $PY -c 'import torch; print("torch", torch.__version__, "cuda",
  torch.version.cuda, torch.cuda.get_device_name(0))'; $PY -c 'import nixl; print("nixl ok")'; } \
  > "$OUT/env.txt" 2>&1
head -24 "$OUT/env.txt"
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-200}" $PY benchmarks/gpu_bench.py --out "$OUT" "$@" 2>&1 \
    | tee "$OUT/gpu_bench.txt" | tail -20
  echo "bench exit ${PIPESTATUS[0]}"
fi
if [ -z "${SKIP_D2H:-}" ]; then
  timeout "${D2H_TIMEOUT:-150}" $PY benchmarks/shm_d2h.py --out "$OUT" ${D2H_ARGS:-} 2>&1 \
    | tee "$OUT/shm_d2h.txt" | tail -3
  echo "shm d2h exit ${PIPESTATUS[0]}"
fi
if [ -z "${SKIP_NIXL_BENCH:-}" ] && $PY -c 'import nixl' 2>/dev/null; then
  timeout "${NIXL_TIMEOUT:-150}" $PY benchmarks/nixl_gpu.py --gib "${NIXL_GIB:-1}" --warm 3 \
    --out "$OUT" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/nixl_gpu.txt" | tail -5
  echo "nixl bench exit ${PIPESTATUS[0]}"
  # two GPUs: the trainer on GPU 0, the receiver on GPU 1 (NIXL's GPU-to-GPU path)
  if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    mkdir -p "$OUT/nixl2"
    timeout "${NIXL_TIMEOUT:-150}" $PY benchmarks/nixl_gpu.py --gib "${NIXL2_GIB:-4}" --warm 5 \
      --devices 0,1 --out "$OUT/nixl2" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/nixl2/nixl_gpu.txt" \
      | tail -5
    echo "nixl 2-GPU bench exit ${PIPESTATUS[0]}"
  fi
fi
timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -v -p no:cacheprovider -rfE -m gpu \
  tests/test_gpu_cuda_ipc.py tests/test_cuda_ipc.py tests/test_nixl.py tests/test_gpu_checksum_order.py \
  tests/test_gpu_shm.py tests/test_gpu_codec.py 2>&1 \
  | grep -v "NIXL INFO" | tee "$OUT/gpu_tests.txt" | tail -45
echo "tests exit ${PIPESTATUS[0]}"
