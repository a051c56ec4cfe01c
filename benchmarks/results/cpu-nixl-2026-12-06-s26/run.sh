#!/bin/bash
# A/B: the bench of 60c2f4f (raw trainer agent with NIXL's thread) vs f7466f0 (polled), same engine code
D=/work/main/benchmarks/results/cpu-nixl-2026-12-06-s26
B="--sizes 1 --receivers 1 --dtypes bfloat16 --methods nixl,nixl-raw --no-hf --warm 5 --quiet"
for i in 1 2; do
  for code in old new; do
    PYTHONPATH=/tmp/ab/$code/src /work/main/.venv/bin/python -m weightsync.tools.cli bench $B --json $D/ab/default_${code}_$i.json > $D/ab/default_${code}_$i.txt 2>&1
    WEIGHTSYNC_NIXL_PIPELINE=0 WEIGHTSYNC_NIXL_SERVE=staging PYTHONPATH=/tmp/ab/$code/src /work/main/.venv/bin/python -m weightsync.tools.cli bench $B --json $D/ab/pipeline_off_${code}_$i.json > $D/ab/pipeline_off_${code}_$i.txt 2>&1
  done
done
for i in 1 2; do
  WEIGHTSYNC_NIXL_SERVE=staging /work/main/.venv/bin/weightsync bench $B --json $D/staging_$i.json > $D/staging_$i.txt 2>&1
  /work/main/.venv/bin/weightsync bench $B --consume copy --threads 0 --json $D/readme_$i.json > $D/readme_$i.txt 2>&1
done
echo DONE
