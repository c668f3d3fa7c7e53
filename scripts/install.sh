#!/usr/bin/env bash
# Install hsdp-serve into the current Python environment.
#
#   scripts/install.sh            # the README's install: editable, with the test extras
#   scripts/install.sh .          # what docker/Dockerfile runs: the package alone
#
# PyTorch goes in first: a plain `torch` requirement on a machine without it would pull a
# multi-GB CUDA build. Machines with an NVIDIA driver get the default (CUDA) build; CPU
# machines get the CPU build pinned below. An already-installed torch in range (the one in the
# PyTorch container image, say) is kept. The range is pyproject.toml's torch requirement.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
cd "$(dirname "$0")/.."

TORCH_MIN=2.8
TORCH_BELOW=2.15
TORCH_CPU_PIN=2.13.0

if ! "$PYTHON" -c "
import sys, torch
v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2])
sys.exit(not (tuple(map(int, '$TORCH_MIN'.split('.'))) <= v < tuple(map(int, '$TORCH_BELOW'.split('.')))))
" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "$PYTHON" -m pip install "torch>=$TORCH_MIN,<$TORCH_BELOW"
    else
        "$PYTHON" -m pip install "torch==$TORCH_CPU_PIN"
    fi
fi
TEST_EXTRAS=0
if [ "$#" -eq 0 ]; then
    set -- -e ".[test]"
    TEST_EXTRAS=1
fi
"$PYTHON" -m pip install "$@"
if [ "$TEST_EXTRAS" -eq 1 ]; then
    # TGI's official Python client, for tests/test_request_surface.py. Without its dependencies:
    # it pins huggingface-hub<1.0, which predates the hub 1.x transformers 5 needs, and uses the
    # hub only for its InferenceAPIClient, which the tests do not; requests and aiohttp come
    # with the test extras.
    "$PYTHON" -m pip install --no-deps "text-generation==0.7.0"
fi
