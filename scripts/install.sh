#!/usr/bin/env bash
# Install hsdp-serve and its test dependencies into the current Python environment.
# PyTorch goes in first: a plain `torch` requirement on a machine without it would pull a
# multi-GB CUDA build. Machines with an NVIDIA driver get the default (CUDA) build; CPU
# machines get the CPU build pinned below. An already-installed torch in range is kept.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
cd "$(dirname "$0")/.."

if ! "$PYTHON" -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(not ((2, 8) <= v < (2, 15)))' 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "$PYTHON" -m pip install "torch>=2.8,<2.15"
    else
        "$PYTHON" -m pip install "torch==2.13.0"
    fi
fi
"$PYTHON" -m pip install -e ".[test]"
