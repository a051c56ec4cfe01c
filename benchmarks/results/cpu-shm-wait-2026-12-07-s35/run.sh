#!/usr/bin/env bash
# Session 35: the shm receiver's wait between direct reads (gaps.py), Qwen2-0.5B bf16, 8 syncs (7 warm), in three codes
# on one sitting, two rounds alternating: 7209436 (11-29, reads from 1 MiB, each waited for), dda6fe7 (11-29, reads from
# 8 MiB, each waited for), and today's code (HEAD) at direct window 1 and 2, from 1 MiB and from 8 MiB.
set -u
HERE=/work/main/benchmarks/results/cpu-shm-wait-2026-12-07-s35
PY=/work/main/.venv/bin/python
for c in 7209436 dda6fe7; do mkdir -p /tmp/c$c && git -C /work/main archive $c src | tar -x -C /tmp/c$c; done
one() {  # name code-src env...
  local name=$1 src=$2; shift 2
  echo "$name start $(date -u +%T) $(cat /proc/loadavg)" >> $HERE/runs.log
  env "$@" CODE=$name PYTHONPATH=$src $PY $HERE/gaps.py 8 >> $HERE/gaps.jsonl 2>> $HERE/gaps.err
}
for r in 1 2; do
  one c7209436 /tmp/c7209436/src
  one now_min1m_w1 /work/main/src WEIGHTSYNC_SHM_DIRECT_MIN=1048576 WEIGHTSYNC_SHM_DIRECT_WINDOW=1
  one now_min1m_w2 /work/main/src WEIGHTSYNC_SHM_DIRECT_MIN=1048576 WEIGHTSYNC_SHM_DIRECT_WINDOW=2
  one cdda6fe7 /tmp/cdda6fe7/src
  one now_min8m_w1 /work/main/src WEIGHTSYNC_SHM_DIRECT_WINDOW=1
  one now_min8m_w2 /work/main/src WEIGHTSYNC_SHM_DIRECT_WINDOW=2
done
echo "end $(date -u +%T) $(cat /proc/loadavg)" >> $HERE/runs.log
