#!/usr/bin/env bash
# The code of cpu-lasting-2026-12-03's run (a958c09) with that run's command less nixl/nixl-raw, twice, quiet box.
set -u
OUT=/work/main/benchmarks/results/cpu-2026-12-06-s27-lastingcode
PY=/work/main/.venv/bin/python
for r in ${RUNS:-1 2}; do
  echo "run $r start $(date -u +%T) $(cat /proc/loadavg)" >> $OUT/runs.log
  PYTHONPATH=/tmp/c1203l/src $PY -m weightsync.tools.cli bench --sizes 1 --receivers 1 --dtypes bfloat16 \
    --methods shm,memcpy --no-hf --warm 5 --quiet --json $OUT/bench_1g_run$r.json > $OUT/bench_1g_run$r.txt 2>&1
  echo "run $r end $(date -u +%T) $(cat /proc/loadavg)" >> $OUT/runs.log
done
