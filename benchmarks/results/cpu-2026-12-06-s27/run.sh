#!/usr/bin/env bash
# Session 27's code (HEAD at the run: commands.txt) on a quiet box: the calibration command of 12-03 with cma-raw added.
set -u
OUT=/work/main/benchmarks/results/cpu-2026-12-06-s27
cd /work/main
echo "start $(date -u +%T) $(cat /proc/loadavg) HEAD $(git rev-parse --short HEAD)" >> $OUT/runs.log
.venv/bin/weightsync bench --sizes 0.25,1 --dtypes bfloat16 --receivers 1,2,4 \
  --methods shm,shm-buckets,shm-direct,collective,memcpy,gloo-flat,memcpy-parallel,cma-raw --warm 5 --quiet \
  --json $OUT/bench.json > $OUT/bench.txt 2>&1
echo "end $(date -u +%T) $(cat /proc/loadavg) exit $?" >> $OUT/runs.log
