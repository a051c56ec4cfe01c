#!/usr/bin/env bash
# Session 29, one H100: --timeline of one warm sync of today's ring (receive_into, 256 MiB and 4 GiB buckets) and of the
# 11-29 code's ring (event, 256 MiB): where a small bucket's ~0.4-0.7 ms goes (gpu-h100-2026-12-06-s29[b]).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/now" "$OUT/c1129"
NONE="--stream-waits-buckets= --no-links-buckets= --into-zero-copy-buckets= --zero-copy-first-bucket-buckets= --rx-waits-buckets= --rx-waits-zero-copy-buckets= --views-buckets= --host-buckets= --zero-copy-buckets= --zero-copy-host-buckets= --baseline-buckets="
PYTHONPATH=src TORCH_CPP_LOG_LEVEL=ERROR timeout 200 python3 benchmarks/gpu_bench.py --warm 3 --timeline --buckets= --into-buckets 256,4096 $NONE --out "$OUT/now" > "$OUT/now/gpu_bench.txt" 2>&1; echo "now exit $?"
(cd devcode/c1129 && PYTHONPATH=src TORCH_CPP_LOG_LEVEL=ERROR timeout 200 python3 benchmarks/gpu_bench.py --warm 3 --timeline --buckets 256 --host-buckets= --zero-copy-buckets= --zero-copy-host-buckets= --baseline-buckets= --out "$OUT/c1129" > "$OUT/c1129/gpu_bench.txt" 2>&1; echo "c1129 exit $?")
grep -h '^| cuda_ipc' $OUT/*/gpu_bench.txt
tar czf /tmp/all.tgz -C "$OUT" . && mv /tmp/all.tgz "$OUT/all.tgz"
