#!/usr/bin/env bash
# Session 35 (2026-12-07): the codes of four recorded CPU runs whose cases miss the planner's
# +-25 % run again, twice each, alternating, on a quiet box (nothing else running), each with
# that run's own command less the cases no calibration reads (see commands.txt):
#   prev  = cpu-2026-11-29/bench-previous-run.json  code 7209436 (shm direct from 1 MiB)
#   fp32  = cpu-2026-11-29/bench-fp32.json          code 7209436
#   mend  = review-2026-12-03/after_mend_1g.json     code 3986479
#   mendw1= review-2026-12-03/shm_window1_mend.json  code 3986479, WEIGHTSYNC_SHM_DIRECT_WINDOW=1
#   delta = delta-2026-12-02/bench_256mib.json        code 26065dd
set -u
OUT=/work/main/benchmarks/results/cpu-2026-12-07-s35-repeats
PY=/work/main/.venv/bin/python
for c in 7209436 3986479 26065dd; do
  mkdir -p /tmp/c$c && git -C /work/main archive $c src | tar -x -C /tmp/c$c
done
log() { echo "$1 $(date -u +%T) $(cat /proc/loadavg)" >> $OUT/runs.log; }
for r in 1 2; do
  cd /tmp/c7209436
  log "prev_r$r start"
  PYTHONPATH=/tmp/c7209436/src $PY -m weightsync.cli bench --sizes 0.25 --dtypes bfloat16 --receivers 1 \
    --methods shm,collective,shm-buckets,shm-direct,memcpy,gloo-flat,memcpy-parallel --warm 5 --quiet \
    --json $OUT/prev_r$r.json > $OUT/prev_r$r.txt 2>&1
  log "fp32_r$r start"
  PYTHONPATH=/tmp/c7209436/src $PY -m weightsync.cli bench --sizes 0.25,1 --dtypes float32 --receivers 1 --no-hf \
    --methods shm,collective,memcpy,gloo-flat,memcpy-parallel --quiet \
    --json $OUT/fp32_r$r.json > $OUT/fp32_r$r.txt 2>&1
  cd /tmp/c3986479
  log "mend_r$r start"
  PYTHONPATH=/tmp/c3986479/src $PY -m weightsync.tools.cli bench --sizes 1 --receivers 1 --dtypes bfloat16 \
    --methods shm,collective,gloo-flat,memcpy --no-hf --warm 7 --quiet \
    --json $OUT/mend_r$r.json > $OUT/mend_r$r.txt 2>&1
  log "mendw1_r$r start"
  WEIGHTSYNC_SHM_DIRECT_WINDOW=1 PYTHONPATH=/tmp/c3986479/src $PY -m weightsync.tools.cli bench --sizes 1 \
    --receivers 1 --dtypes bfloat16 --methods shm,memcpy --no-hf --warm 7 --quiet \
    --json $OUT/mendw1_r$r.json > $OUT/mendw1_r$r.txt 2>&1
  cd /tmp/c26065dd
  log "delta_r$r start"
  PYTHONPATH=/tmp/c26065dd/src $PY -m weightsync.tools.cli bench --sizes 256MiB --dtypes bfloat16 --receivers 1,2 \
    --methods shm,delta+shm,collective,delta+collective,nixl,delta+nixl,memcpy,gloo-flat,memcpy-parallel \
    --no-hf --changed 0.005 --warm 5 --quiet --json $OUT/delta_r$r.json > $OUT/delta_r$r.txt 2>&1
  log "round $r end"
done
