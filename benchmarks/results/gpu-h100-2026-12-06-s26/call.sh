#!/usr/bin/env bash
# cuda_ipc ring of the code of 11-29 (0218da3) and of 12-01 (1005ea0), the same gpu_bench.py
# (identical in both), alternating, 2 rounds; then one --timeline run of each.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd "$(dirname "$0")"
{ date -u; nvidia-smi; lscpu | head -20; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; } > "$OUT/env.txt" 2>&1
head -16 "$OUT/env.txt" | tail -8
A="--warm 8 --buckets 1024,2048 --host-buckets 1024 --zero-copy-buckets= --zero-copy-host-buckets= --baseline-buckets="
for r in 1 2 3; do for c in c1129 c1201; do
  mkdir -p "$OUT/$c/r$r"
  (cd $c && PYTHONPATH=src TORCH_CPP_LOG_LEVEL=ERROR timeout 200 python3 benchmarks/gpu_bench.py $A --out "$OUT/$c/r$r" > "$OUT/$c/r$r/gpu_bench.txt" 2>&1)
  echo "$c r$r exit $? $(grep -h '^| cuda_ipc' $OUT/$c/r$r/gpu_bench.txt | awk -F'|' '{print $3 $4 $6}' | tr '\n' ';')"
done; done
for c in c1129 c1201; do
  mkdir -p "$OUT/$c/timeline"
  (cd $c && PYTHONPATH=src TORCH_CPP_LOG_LEVEL=ERROR timeout 150 python3 benchmarks/gpu_bench.py --warm 3 --buckets 1024 --host-buckets= --zero-copy-buckets= --zero-copy-host-buckets= --baseline-buckets= --timeline --out "$OUT/$c/timeline" > "$OUT/$c/timeline/gpu_bench.txt" 2>&1)
  echo "$c timeline exit $?"; tail -5 "$OUT/$c/timeline/gpu_bench.txt"
done
tar czf /tmp/all.tgz -C "$OUT" . && mv /tmp/all.tgz "$OUT/all.tgz"
