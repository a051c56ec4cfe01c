#!/usr/bin/env bash
# Session 29, one H100: the ring codes of 11-29 (c1129) and 12-01 (c1201) at bucket sizes session 26 did not time
# (256 MiB, 512 MiB, 4 GiB event; 4 GiB host), alternating, two rounds: out-of-sample rows for the fitted 11-29 costs.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd "$(dirname "$0")"
{ date -u; nvidia-smi; lscpu | head -20; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; } > "$OUT/env.txt" 2>&1
for r in 1 2; do
  for code in c1129 c1201; do
    mkdir -p "$OUT/$code/r$r"
    (cd $code && PYTHONPATH=src TORCH_CPP_LOG_LEVEL=ERROR timeout 200 python3 benchmarks/gpu_bench.py --warm 8 --buckets 256,512,4096 --host-buckets 4096 --zero-copy-buckets= --zero-copy-host-buckets= --baseline-buckets= --out "$OUT/$code/r$r" > "$OUT/$code/r$r/gpu_bench.txt" 2>&1)
    echo "$code r$r exit $? $(grep -h '^| cuda_ipc' $OUT/$code/r$r/gpu_bench.txt | awk -F'|' '{print $2 $3 $4 $6}' | tr '\n' ';')"
  done
done
tar czf /tmp/all.tgz -C "$OUT" . && mv /tmp/all.tgz "$OUT/all.tgz"
