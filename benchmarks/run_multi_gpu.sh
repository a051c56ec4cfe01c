#!/usr/bin/env bash
# One device call on a machine of 2+ GPUs (issue: multi-GPU runs). Everything lands in $OUT:
#   env.txt         GPUs, links (nvidia-smi topo -m), torch/NCCL/NIXL versions
#   nixl_multi.txt  nixl across GPUs: 1 -> 1 whole, 2 -> 2 TP-2 slices (full and Shard(0)
#                   trainers; full also consumed as the README's receive_weights loop),
#                   each beside a raw NIXL READ of the same bytes and a raw NCCL broadcast
#                   (benchmarks/nixl_multi.py; one JSON line per case)
#   collective.txt  collective on NCCL, 1 -> 1: conformance cases, then 16 GB bf16 with
#                   receive_into and with the README's loop beside a raw NCCL broadcast
#                   (benchmarks/multi_gpu.py; multi_gpu.json holds the same)
#   gpu_tests.txt   tests/test_gpu_multi.py (every GPU backend across GPUs, a rollout
#                   killed mid-sync) and the VRAM tests of tests/test_nixl.py
# NIXL: carry .wheels-device (nixl + nixl-cu13 wheels); without it the nixl steps skip.
#   OUT=/tmp/out bash benchmarks/run_multi_gpu.sh
# SKIP_NIXL=1 / SKIP_COLLECTIVE=1 / SKIP_TESTS=1 skip a part. NVLink multicast stays off.
set -u -o pipefail
OUT=${OUT:-/tmp/weightsync-multi}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_CPP_LOG_LEVEL=ERROR
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
if ls .wheels-device/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels-device/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
{ date -u; nvidia-smi; nvidia-smi topo -m; $PY -c 'import torch; print("torch", torch.__version__,
  "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), torch.cuda.device_count(), "GPUs")';
  $PY -c 'import nixl; print("nixl ok")'; } > "$OUT/env.txt" 2>&1
tail -8 "$OUT/env.txt"
if [ -z "${SKIP_NIXL:-}" ] && $PY -c 'import nixl' 2>/dev/null; then
  for args in "--trainers 1 --tp 1" "--trainers 2 --tp 2" "--trainers 2 --tp 2 --shards" \
              "--trainers 2 --tp 2 --consume copy"; do
    echo "== nixl_multi $args" | tee -a "$OUT/nixl_multi.txt"
    timeout "${NIXL_TIMEOUT:-150}" $PY benchmarks/nixl_multi.py \
      --gib "${NIXL_GIB:-4}" --warm 5 --devices 0,1 --out /tmp/nixl_multi $args 2>&1 \
      | grep -v "NIXL INFO" | tee -a "$OUT/nixl_multi.txt" | tail -3
    echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/nixl_multi.txt"
  done
fi
if [ -z "${SKIP_COLLECTIVE:-}" ]; then
  timeout "${COLL_TIMEOUT:-200}" $PY benchmarks/multi_gpu.py --out "$OUT" --gb 16 --buckets 1024 \
    --consume into,copy --warm 5 --cases plain,cast_bf16,version_mismatch 2>&1 \
    | tee "$OUT/collective.txt" | grep -v "^plain\|^cast" | cut -c1-600
  echo "collective exit ${PIPESTATUS[0]}"
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-240}" $PY -m pytest -v -p no:cacheprovider -rfE -m gpu \
    tests/test_gpu_multi.py tests/test_nixl.py 2>&1 | grep -v "NIXL INFO" \
    | tee "$OUT/gpu_tests.txt" | tail -30
  echo "tests exit ${PIPESTATUS[0]}"
fi
