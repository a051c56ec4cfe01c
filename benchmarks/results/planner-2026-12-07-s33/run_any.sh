#!/usr/bin/env bash
# Session 33: an H200 runs today's ring (run_s33_h200.sh), an H100 the three codes (run_s33.sh).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash devcode/run_s33_h200.sh
else
  bash devcode/run_s33.sh
fi
