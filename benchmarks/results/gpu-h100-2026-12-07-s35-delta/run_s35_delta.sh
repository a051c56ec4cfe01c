#!/usr/bin/env bash
# Session 35 (copy of session 34's run_s34_delta.sh, unchanged but this line): delta+cuda_ipc on one GPU. The codec's kernels on this GPU (delta_bench.py --kernels: the
# host's links.codec rates), then gpu_bench.py's delta rows (receive_into, --changed 0.005 and 0.05 of the
# trainer's elements between syncs) beside the dense ring at the same bucket sizes, two rounds alternating.
set -u
RES=${OUT:-/tmp/out}; OUT=/tmp/wd; mkdir -p "$OUT" "$RES"
{ date -u; nvidia-smi; lscpu | head -20; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; } > "$OUT/env.txt" 2>&1
export PYTHONPATH=src TORCH_CPP_LOG_LEVEL=ERROR
NONE="--buckets= --host-buckets= --zero-copy-buckets= --zero-copy-host-buckets= --baseline-buckets= --stream-waits-buckets= --no-links-buckets= --into-zero-copy-buckets= --zero-copy-first-bucket-buckets= --rx-waits-buckets= --rx-waits-zero-copy-buckets= --views-buckets="
save() { cp devcode/run_s35_delta.sh "$OUT/"; tar czf /tmp/d.tgz -C "$OUT" . && mv /tmp/d.tgz "$RES/all.tgz"; }
timeout 120 python3 benchmarks/delta_bench.py --kernels > "$OUT/kernels.json" 2> "$OUT/kernels.err"; echo "kernels exit $?" | tee -a "$RES/progress.txt"; save
for r in 1 2; do
  for ch in 0.005 0.05; do
    d=r$r/c$ch; mkdir -p "$OUT/$d"; t0=$(date +%s)
    timeout 200 python3 benchmarks/gpu_bench.py --warm 5 $NONE --into-buckets 256,1024 --into-delta-buckets 256,1024 --changed $ch --out "$OUT/$d" > "$OUT/$d/gpu_bench.txt" 2>&1
    echo "$d exit $? $(( $(date +%s) - t0 )) s: $(grep -h '^| ' $OUT/$d/gpu_bench.txt | grep -v config | awk -F'|' '{print $2 $4 $6}' | tr '\n' ';')" | tee -a "$RES/progress.txt"; save
  done
done
