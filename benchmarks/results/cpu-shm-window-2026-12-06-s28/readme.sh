#!/usr/bin/env bash
# The direct window at 1 and 2 once each, consumed as the README says (shm@readme: receive_into, torch's default threads)
# beside the bench's default (shm), 1 GiB synthetic and Qwen2, R=1.
set -u
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
for w in 1 2; do
  WEIGHTSYNC_SHM_DIRECT_WINDOW=$w .venv/bin/weightsync bench --sizes 1 --receivers 1 --dtypes bfloat16 \
    --methods shm,shm@readme,memcpy --warm 5 --quiet --json "$here/readme_window$w.json" > "$here/readme_window$w.txt" 2>&1
  echo "window $w exit $? $(grep -E '^shm' "$here/readme_window$w.txt" | awk '{print $1"="$4}' | tr '\n' ' ')" >> "$here/readme.log"
done
