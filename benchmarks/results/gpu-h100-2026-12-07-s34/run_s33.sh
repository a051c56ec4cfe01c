#!/usr/bin/env bash
# Session 33 (= run_s32.sh + a CPU-speed probe before each bench: C lines in hostload.txt).
# Session 32: a host probe before and after timed rounds, on one machine. Each ring code's --timeline run with every warm sync
# printed (today's gpu_bench; the old codes' benches patched alike: devcode/timeline_every_sync_<code>.patch), then three timed
# rounds alternating the codes (session 30's commands), then the timelines again; the host's load recorded throughout.
# c1129 / c1201: the ring codes of 11-29 (0218da3) and 12-01 (1005ea0); now: today's tree (receive_into).
set -u
RES=${OUT:-/tmp/out}; OUT=/tmp/w; mkdir -p "$OUT" "$RES"
( while :; do echo "S $(date +%s.%N) $(head -1 /proc/stat) $(cat /proc/loadavg)"; sleep 0.5; done >> "$OUT/hostload.txt" ) &
SAMPLER0=$!
# which CPU each thread of the bench's python processes last ran on, and its share of a CPU (hyperthread siblings: env.txt's lscpu -e)
( while :; do echo "P $(date +%s.%N)"; ps -eLo pid,tid,psr,pcpu,comm --no-headers | awk '$5 ~ /python/ && $4 > 5'; sleep 1; done >> "$OUT/placement.txt" ) &
SAMPLER=$!
trap "kill $SAMPLER0 $SAMPLER" EXIT
{ date -u; nvidia-smi; lscpu | head -20; lscpu -e; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; } > "$OUT/env.txt" 2>&1
NONE="--stream-waits-buckets= --no-links-buckets= --into-zero-copy-buckets= --zero-copy-first-bucket-buckets= --rx-waits-buckets= --rx-waits-zero-copy-buckets= --views-buckets= --zero-copy-buckets= --zero-copy-host-buckets= --baseline-buckets="
OLD="--zero-copy-buckets= --zero-copy-host-buckets= --baseline-buckets="
cpuprobe() {  # one core's speed: a fixed pure-Python loop and a fixed torch CPU op, seconds each (median of 3)
  python3 -c "
import time, statistics, torch
def loop():
    t = time.perf_counter(); s = 0
    for i in range(2_000_000): s += i
    return time.perf_counter() - t
x = torch.ones(1 << 12)
def small_ops():   # host-side dispatch cost, like a kernel launch's Python part
    t = time.perf_counter()
    for _ in range(20_000): x.add_(1)
    return time.perf_counter() - t
def naps():   # what time.sleep(100 us) takes here: the engines' polling loops sleep 10-100 us between polls
    out = []
    for _ in range(300):
        t = time.perf_counter(); time.sleep(100e-6); out.append(time.perf_counter() - t)
    out.sort()
    return [round(out[int(q * (len(out) - 1))] * 1e6) for q in (0.1, 0.5, 0.9, 0.99)]
print('C', time.time(), '$1', round(statistics.median(loop() for _ in range(3)), 4), round(statistics.median(small_ops() for _ in range(3)), 4), *naps())
" >> "$OUT/hostload.txt" 2>&1
}
bench() {  # dir code args...
  local d=$1 code=$2; shift 2; mkdir -p "$OUT/$d"; cpuprobe "before $d"
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
timelines() {  # tl<k>
  for code in c1129 c1201; do
    bench $1/$code $code --warm 6 --timeline --buckets 256,512,1024,4096 --host-buckets 1024,4096 $OLD
  done
  bench $1/now now --warm 6 --ring-probe   # the README's probe: receive_into at 256 MiB - 4 GiB event, 1 / 4 GiB host
}
timelines tl
for r in ${ROUNDS:-1 2 3}; do
  for code in c1129 c1201; do
    bench $code/r$r $code --warm 8 --buckets 256,512,1024 --host-buckets 1024,4096 $OLD
  done
  bench now/r$r now --warm 8 --buckets= --host-buckets= --into-buckets 256,512 --into-host-buckets 1024,4096 $NONE
done
[ "${AFTER:-1}" = 1 ] && timelines tl2
