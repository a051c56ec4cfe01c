#!/usr/bin/env bash
# Session 21, device call 4: batched fill programs against the plain ring, 4 GiB, settled
# and not, two rounds of 11 warm syncs; then the race tests call 3 did not reach (the
# fill-program mutant among them), fill_graphs on wherever a test leaves it to the environment.
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
  env $envs timeout ${T:-100} python3 benchmarks/gpu_bench.py --out $R/$name "${F[@]}" ${EXTRA:-} "$@" > $R/$name.txt 2>&1
  echo "exit $?"; grep -E "^engine|^d2d" $R/$name.txt | python3 -c '
import sys, json
for line in sys.stdin:
    k, _, rest = line.partition(" ")
    if k == "d2d": print(line.strip()); continue
    d = json.loads(rest); c = d["cfg"]
    print(c.get("bucket_size",0)>>20, {k2:v for k2,v in c.items() if k2 not in ("bucket_size","num_slots","sync")}, "median", round(d["median_ms"],2), "span", round(d.get("rx_gpu_span_ms") or 0,2), "ok", d["all_ok"])'
}
for round in 1 2; do
  for st in 0 200; do
    run r${round}_settle$st GPU_BENCH_SETTLE_MS=$st --warm 11 --into-buckets 4096 --into-zero-copy-buckets "" --into-fill-graphs-buckets 4096 --baseline-buckets "" --timeline
  done
done
WEIGHTSYNC_CUDA_IPC_FILL_GRAPHS=1 timeout 240 python3 -m pytest -v -p no:cacheprovider -rfE -m gpu tests/test_gpu_cuda_ipc.py -k "race_checks or graphed_copies or fill" 2>&1 | tee $R/gpu_tests_cuda_ipc.txt | tail -4
cd $OUT && tar czf s21_call4.tgz r && rm -rf r
