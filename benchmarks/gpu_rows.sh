# Sourced by a device call's script: named gpu_bench.py runs, each with its own environment,
# every default bucket row off (the caller names the rows it wants), a one-line summary of
# each configuration on stdout, everything under $OUT/r (tar it into one file at the end:
# a call brings back at most 8 files).
#   source benchmarks/gpu_rows.sh   # from the repository root, OUT set
#   rows NAME "ENV=1 ENV2=2" --warm 7 --into-buckets 4096 ...
# T: seconds per run (default 100); EXTRA: more gpu_bench.py options (e.g. "--cpu-smoke
# --scale 16" to try a script on CPU first).
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_CPP_LOG_LEVEL=ERROR
R=$OUT/r; mkdir -p "$R"
{ date -u; nvidia-smi; } > "$R/env.txt" 2>&1
NO_ROWS=(--buckets "" --host-buckets "" --zero-copy-buckets "" --zero-copy-host-buckets ""
         --stream-waits-buckets "" --no-links-buckets "" --zero-copy-first-bucket-buckets ""
         --rx-waits-buckets "" --rx-waits-zero-copy-buckets "" --views-buckets ""
         --into-push-buckets "")
rows() {
  local name=$1 envs=$2; shift 2
  echo "== $name: $envs gpu_bench.py ${NO_ROWS[*]} $*" | tee -a "$R/commands.txt"
  mkdir -p "$R/$name"
  # shellcheck disable=SC2086  # envs and EXTRA are word lists
  env $envs timeout "${T:-100}" python3 benchmarks/gpu_bench.py --out "$R/$name" "${NO_ROWS[@]}" \
    ${EXTRA:-} "$@" > "$R/$name.txt" 2>&1
  echo "exit $?"
  grep -E "^engine|^d2d" "$R/$name.txt" | python3 -c '
import sys, json
for line in sys.stdin:
    k, _, rest = line.partition(" ")
    if k == "d2d":
        print(line.strip())
        continue
    d = json.loads(rest)
    c = d["cfg"]
    print(c.get("bucket_size", 0) >> 20,
          {k2: v for k2, v in c.items() if k2 not in ("bucket_size", "num_slots", "sync")},
          "median", round(d["median_ms"], 2), "span", round(d.get("rx_gpu_span_ms") or 0, 2),
          "ok", d["all_ok"])'
}
