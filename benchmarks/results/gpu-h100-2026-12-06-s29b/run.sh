#!/usr/bin/env bash
# Session 29, one H100: today's cuda_ipc ring (the working tree) at small buckets, receive_into (the README's consumer) and
# views, two rounds: out-of-sample rows for the presets' host costs of the current code (19 us a tensor, 150 us a bucket).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ date -u; nvidia-smi; lscpu | head -20; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; git log -1 --format=%H 2>/dev/null; } > "$OUT/env.txt" 2>&1
for r in 1 2; do
  mkdir -p "$OUT/r$r"
  PYTHONPATH=src TORCH_CPP_LOG_LEVEL=ERROR timeout 250 python3 benchmarks/gpu_bench.py --warm 8 --into-buckets 256,512,1024,4096 --buckets 256,1024 --host-buckets= --zero-copy-buckets= --zero-copy-host-buckets= --baseline-buckets= --out "$OUT/r$r" > "$OUT/r$r/gpu_bench.txt" 2>&1
  echo "r$r exit $? $(grep -h '^| cuda_ipc' $OUT/r$r/gpu_bench.txt | awk -F'|' '{print $2 $3 $4 $6}' | tr '\n' ';')"
done
tar czf /tmp/all.tgz -C "$OUT" . && mv /tmp/all.tgz "$OUT/all.tgz"
