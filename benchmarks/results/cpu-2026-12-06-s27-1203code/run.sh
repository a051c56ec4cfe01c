#!/usr/bin/env bash
# The code of 12-03's calibration run (cpu-calib-2026-12-03: HEAD 4a44e05 when it started; see commands.txt),
# its command less the 1 and 4 GiB workloads and collective, twice, on a quiet box. Run from /tmp/c1203.
set -u
OUT=/work/main/benchmarks/results/cpu-2026-12-06-s27-1203code
PY=/work/main/.venv/bin/python
for r in 1 2; do
  echo "run $r start $(date -u +%T) $(cat /proc/loadavg)" >> $OUT/runs.log
  PYTHONPATH=/tmp/c1203/src $PY -m weightsync.tools.cli bench --sizes 0.25 --dtypes bfloat16 --receivers 1,2,4 \
    --methods shm,shm-buckets,shm-direct,memcpy,gloo-flat,memcpy-parallel --warm 5 --quiet \
    --json $OUT/bench_run$r.json > $OUT/bench_run$r.txt 2>&1
  echo "run $r end $(date -u +%T) $(cat /proc/loadavg)" >> $OUT/runs.log
done
