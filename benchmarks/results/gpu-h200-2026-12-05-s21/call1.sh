#!/usr/bin/env bash
# Session 21, device call 1: settled and unsettled ring / zero-copy / fill_graphs rows with
# flat_after_draw_ms, then every ring row with both sides' stream waits (env options).
set -u
cd "$(dirname "$0")/../../.."
source benchmarks/gpu_rows.sh   # (these helpers were inline in the script that ran)
T=${T:-190}
rows settle200 GPU_BENCH_SETTLE_MS=200 --warm 7 --into-buckets 4096 --into-zero-copy-buckets 1024 --into-fill-graphs-buckets 4096 --baseline-buckets 2048 --timeline
rows settle0 GPU_BENCH_SETTLE_MS=0 --warm 7 --into-buckets 4096 --into-zero-copy-buckets 1024 --into-fill-graphs-buckets 4096 --baseline-buckets "" --timeline
rows waits200 "GPU_BENCH_SETTLE_MS=200 WEIGHTSYNC_CUDA_IPC_STREAM_WAITS=1 WEIGHTSYNC_CUDA_IPC_RX_STREAM_WAITS=1" --warm 7 --into-buckets 2048,4096 --into-zero-copy-buckets 1024 --into-fill-graphs-buckets "" --baseline-buckets "" --timeline
cd $OUT && tar czf s21_call1.tgz r && rm -rf r
