#!/usr/bin/env bash
# Session 33, a second machine of either kind as a held-out check: an H200 runs today's ring (run_s33_h200.sh),
# an H100 the three codes' timelines and two rounds (run_s33.sh, ROUNDS="1 2" AFTER=0).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash devcode/run_s33_h200.sh
else
  ROUNDS="1 2" AFTER=0 bash devcode/run_s33.sh
fi
