#!/usr/bin/env bash
# Only on an H200: the code of 12-01 (1005ea0) with the command of gpu-h200-2026-12-01's run, three times.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd "$(dirname "$0")"
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $name"
case "$name" in *H200*) ;; *) echo "not an H200: nothing run"; exit 3;; esac
{ date -u; nvidia-smi; lscpu | head -20; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; } > "$OUT/env.txt" 2>&1
for r in 1 2 3; do
  mkdir -p "$OUT/r$r"
  (cd c1201 && PYTHONPATH=src TORCH_CPP_LOG_LEVEL=ERROR timeout 180 python3 benchmarks/gpu_bench.py --warm 3 --buckets 1024,2048 --host-buckets 1024 --zero-copy-buckets 1024 --zero-copy-host-buckets 1024 --baseline-buckets 2048 --out "$OUT/r$r" > "$OUT/r$r/gpu_bench.txt" 2>&1)
  echo "r$r exit $? $(grep -h '^| cuda_ipc' $OUT/r$r/gpu_bench.txt | awk -F'|' '{print $2 $3 $4 $6}' | tr '\n' ';')"
done
tar czf /tmp/all.tgz -C "$OUT" . && mv /tmp/all.tgz "$OUT/all.tgz"
