#!/usr/bin/env bash
# Session 27's calibration run (cpu-2026-12-06-s27/bench.json) again: its code (git archive f3939a7 src) and its command,
# RUNS times on a quiet box; each run's cases are repeats of session 27's (calibrate.REPEATS).
set -u
OUT=/work/main/benchmarks/results/cpu-2026-12-06-s28-s27code
CODE=/tmp/c1206s27
rm -rf $CODE && mkdir -p $CODE && (cd /work/main && git archive f3939a7 src | tar -x -C $CODE)
cd /work/main
for r in $(seq 1 "${RUNS:-2}"); do
  echo "run $r start $(date -u +%T) $(cat /proc/loadavg)" >> $OUT/runs.log
  PYTHONPATH=$CODE/src .venv/bin/python -m weightsync.tools.cli bench --sizes 0.25,1 --dtypes bfloat16 --receivers 1,2,4 \
    --methods shm,shm-buckets,shm-direct,collective,memcpy,gloo-flat,memcpy-parallel,cma-raw --warm 5 --quiet \
    --json $OUT/bench_run$r.json > $OUT/bench_run$r.txt 2>&1
  rc=$?
  echo "run $r end $(date -u +%T) $(cat /proc/loadavg) exit $rc" >> $OUT/runs.log
done
