#!/usr/bin/env bash
# Today's shm with the direct window at 1 (each direct read waited for: the code before 4978907) and at 2 (the default),
# alternating, RUNS rounds: 1 GiB synthetic and Qwen2-0.5B shapes, R=1, shm and its paired memcpy.
set -u
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
for r in $(seq 1 "${RUNS:-3}"); do
  for w in 1 2; do
    uptime >> "$here/runs.log"
    WEIGHTSYNC_SHM_DIRECT_WINDOW=$w .venv/bin/weightsync bench --sizes 1 --receivers 1 --dtypes bfloat16 \
      --methods shm,memcpy --warm 5 --quiet --json "$here/window${w}_r$r.json" > "$here/window${w}_r$r.txt" 2>&1
    echo "r$r window $w exit $? $(grep -E '^shm ' "$here/window${w}_r$r.txt" | awk '{print $4}' | tr '\n' ' ')" >> "$here/runs.log"
  done
done
