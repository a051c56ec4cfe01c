#!/usr/bin/env bash
# Session 31: session 30's runs again (each ring code's --timeline, then four timed rounds alternating the codes) with the host's
# load recorded beside them (hostload.txt: /proc/stat's cpu line and /proc/loadavg every 0.5 s, each bench's start and end).
# c1129 / c1201: the ring codes of 11-29 (0218da3) and 12-01 (1005ea0); now: today's tree (receive_into).
# ROUNDS (default "1 2 3 4"): the timed rounds; TIMELINES=0 skips step 1 .
set -u
RES=${OUT:-/tmp/out}; OUT=/tmp/w; mkdir -p "$OUT" "$RES"
ROOT=$(pwd)
( while :; do echo "S $(date +%s.%N) $(head -1 /proc/stat) $(cat /proc/loadavg)"; sleep 0.5; done >> "$OUT/hostload.txt" ) &
SAMPLER=$!
trap "kill $SAMPLER" EXIT
{ date -u; nvidia-smi; lscpu | head -20; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; } > "$OUT/env.txt" 2>&1
NONE="--stream-waits-buckets= --no-links-buckets= --into-zero-copy-buckets= --zero-copy-first-bucket-buckets= --rx-waits-buckets= --rx-waits-zero-copy-buckets= --views-buckets= --zero-copy-buckets= --zero-copy-host-buckets= --baseline-buckets="
OLD="--zero-copy-buckets= --zero-copy-host-buckets= --baseline-buckets="
bench() {  # dir code args...
  local d=$1 code=$2; shift 2; mkdir -p "$OUT/$d"
  local t0=$(date +%s.%N); echo "B $t0 $d" >> "$OUT/hostload.txt"
  if [ "$code" = now ]; then
    PYTHONPATH=src TORCH_CPP_LOG_LEVEL=ERROR timeout 110 python3 benchmarks/gpu_bench.py "$@" --out "$OUT/$d" > "$OUT/$d/gpu_bench.txt" 2>&1
  else
    (cd devcode/$code && PYTHONPATH=src TORCH_CPP_LOG_LEVEL=ERROR timeout 110 python3 benchmarks/gpu_bench.py "$@" --out "$OUT/$d" > "$OUT/$d/gpu_bench.txt" 2>&1)
  fi
  local rc=$?; echo "E $(date +%s.%N) $d" >> "$OUT/hostload.txt"
  echo "$d exit $rc $(python3 -c "print(round($(date +%s.%N)-$t0,1))") s: $(grep -h '^| cuda_ipc' $OUT/$d/gpu_bench.txt | awk -F'|' '{print $2 $3 $4 $6}' | tr '\n' ';')" | tee -a "$RES/progress.txt"
  tar czf /tmp/all.tgz -C "$OUT" . && mv /tmp/all.tgz "$RES/all.tgz"
}
# 1. timelines (the last warm sync of each configuration, both processes' engine steps on one clock)
if [ "${TIMELINES:-1}" = 1 ]; then
  for code in c1129 c1201; do
    bench tl/$code $code --warm 3 --timeline --buckets 256,512,1024,4096 --host-buckets 1024,4096 $OLD
  done
  bench tl/now now --warm 3 --timeline --buckets= --host-buckets= --into-buckets 256,512,1024,4096 --into-host-buckets 1024,4096 $NONE
fi
# 2. timed runs, alternating, four rounds
for r in ${ROUNDS:-1 2 3 4}; do
  for code in c1129 c1201; do
    bench $code/r$r $code --warm 8 --buckets 256,512,1024 --host-buckets 1024,4096 $OLD
  done
  bench now/r$r now --warm 8 --buckets= --host-buckets= --into-buckets 256,512 --into-host-buckets 1024,4096 $NONE
done
