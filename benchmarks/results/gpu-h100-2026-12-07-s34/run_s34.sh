#!/usr/bin/env bash
# Session 34: session 33's held-out check (run_any2.sh: an H200 runs today's ring, an H100 the three codes' timelines and
# two rounds) with the GPU's clocks, temperature, power and throttle reasons sampled every second beside the host's load
# (gpuclk.txt), to see whether a slow round is the GPU's or the host's.
mkdir -p /tmp/w
( while :; do nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active,utilization.gpu --format=csv,noheader; sleep 1; done >> /tmp/w/gpuclk.txt 2>&1 ) &
CLK=$!
trap "kill $CLK" EXIT
bash devcode/run_any2.sh
