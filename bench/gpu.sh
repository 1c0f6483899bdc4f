#!/usr/bin/env bash
# The GPU backend's checks and figures in one run (the H200's figures: bench/README.md):
#   bash bench/gpu.sh           on the lent H200 through the device tool, carry [".whl"]; under 8 minutes
#   bash bench/gpu.sh --smoke   here on the CPU: the same phases on the embedded model's shape, tiny numbers
#   bash bench/gpu.sh --phases http,transformers   a rerun of some phases (tests, tailrace, http, transformers)
#   bash bench/gpu.sh --phases tailrace,http --eager   the same without CUDA graphs, if their capture fails
#   bash bench/gpu.sh --profile [--smoke]   bench/gpu_profile.py instead: where a step's time goes
# Everything it prints also goes to $OUT/gpu.log (gpu_profile.log with --profile; bench/out when
# $OUT is unset), beside gpu.json, http.json and each phase's log; bench/gpu_bench.py says what the
# phases are.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
script=bench/gpu_bench.py log=gpu.log
if [ "${1:-}" = --profile ]; then
    script=bench/gpu_profile.py log=gpu_profile.log
    shift
fi

main() {
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
    local python=python3
    if [ "${1:-}" = --smoke ]; then
        python=.venv/bin/python
    else
        # Nothing can be downloaded there: the packages its image lacks come as wheels
        # (bench/gpu_wheels.sh, run here first), and tailrace runs from this checkout.
        ls .whl/*.whl > /dev/null || { echo "no wheels: run bench/gpu_wheels.sh here, carry [\".whl\"]"; return 1; }
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
        export PYTHONPATH=/tmp/site:$PWD
    fi
    nvidia-smi || echo "no nvidia-smi: no GPU here"
    "$python" "$script" --out "$OUT" "$@"
}

# A pipeline, not exec > >(tee ...): the script ends only after tee has written the table.
main "$@" 2>&1 | tee "$OUT/$log"
