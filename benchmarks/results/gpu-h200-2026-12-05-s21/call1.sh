#!/usr/bin/env bash
# Session 21, device call 1: settled and unsettled ring / zero-copy / fill_graphs rows with
# flat_after_draw_ms, then every ring row with both sides' stream waits (env options).
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_CPP_LOG_LEVEL=ERROR
R=$OUT/r; mkdir -p $R
{ date -u; nvidia-smi; } > $R/env.txt 2>&1
F=(--buckets "" --host-buckets "" --zero-copy-buckets "" --zero-copy-host-buckets "" --stream-waits-buckets "" --no-links-buckets "" --zero-copy-first-bucket-buckets "" --rx-waits-buckets "" --rx-waits-zero-copy-buckets "" --views-buckets "")
run() { # name "ENV=.. ENV=.." args...
  local name=$1 envs=$2; shift 2
  echo "== $name: $envs gpu_bench.py ${F[*]} $*" | tee -a $R/commands.txt
  mkdir -p $R/$name
  env $envs timeout ${T:-190} python3 benchmarks/gpu_bench.py --out $R/$name "${F[@]}" ${EXTRA:-} "$@" > $R/$name.txt 2>&1
  echo "exit $?"; grep -E "^engine|^d2d" $R/$name.txt | python3 -c '
import sys, json
for line in sys.stdin:
    k, _, rest = line.partition(" ")
    if k == "d2d": print(line.strip()); continue
    d = json.loads(rest); c = d["cfg"]
    print(c.get("bucket_size",0)>>20, {k2:v for k2,v in c.items() if k2 not in ("bucket_size","num_slots","sync")}, "median", round(d["median_ms"],2), "span", round(d.get("rx_gpu_span_ms") or 0,2), "ok", d["all_ok"])'
}
run settle200 GPU_BENCH_SETTLE_MS=200 --warm 7 --into-buckets 4096 --into-zero-copy-buckets 1024 --into-fill-graphs-buckets 4096 --baseline-buckets 2048 --timeline
run settle0 GPU_BENCH_SETTLE_MS=0 --warm 7 --into-buckets 4096 --into-zero-copy-buckets 1024 --into-fill-graphs-buckets 4096 --baseline-buckets "" --timeline
run waits200 "GPU_BENCH_SETTLE_MS=200 WEIGHTSYNC_CUDA_IPC_STREAM_WAITS=1 WEIGHTSYNC_CUDA_IPC_RX_STREAM_WAITS=1" --warm 7 --into-buckets 2048,4096 --into-zero-copy-buckets 1024 --into-fill-graphs-buckets "" --baseline-buckets "" --timeline
cd $OUT && tar czf s21_call1.tgz r && rm -rf r
