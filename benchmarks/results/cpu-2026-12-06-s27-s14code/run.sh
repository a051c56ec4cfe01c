#!/usr/bin/env bash
# The code of session 14's CPU run (cpu-2026-12-04-s14: git archive 299c7f2 src, whose src is a98961a's),
# its two `tuned` commands alternating, three rounds, on a quiet box. Run from /tmp/c1204s14.
set -u
OUT=/work/main/benchmarks/results/cpu-2026-12-06-s27-s14code
PY=/work/main/.venv/bin/python
for r in 1 2 3; do
  echo "round $r start $(date -u +%T) $(cat /proc/loadavg)" >> $OUT/runs.log
  PYTHONPATH=/tmp/c1204s14/src $PY -m weightsync.tools.cli bench --sizes 1 --receivers 1 --dtypes bfloat16 --methods shm,memcpy,cma-raw --no-hf --warm 7 --quiet --json $OUT/tuned_r$r.json > $OUT/tuned_r$r.txt 2>&1
  WEIGHTSYNC_SHM_DIRECT_MIN=1048576 PYTHONPATH=/tmp/c1204s14/src $PY -m weightsync.tools.cli bench --sizes 1 --receivers 1 --dtypes bfloat16 --methods shm,memcpy,cma-raw --no-hf --warm 7 --quiet --json $OUT/tuned_direct1m_r$r.json > $OUT/tuned_direct1m_r$r.txt 2>&1
  echo "round $r end $(date -u +%T) $(cat /proc/loadavg)" >> $OUT/runs.log
done
