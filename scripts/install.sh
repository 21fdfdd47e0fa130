#!/usr/bin/env bash
# Install kvbuffer into the current Python environment.
#   bash scripts/install.sh          the package, its runtime deps and Triton (for kvbuffer_fast)
#   bash scripts/install.sh test     ... plus the test extras (pytest, hypothesis, pytest-benchmark, crosscheck deps)
# PyTorch: if no torch is importable, the CPU build torch==2.13.0 is installed first, so that the
# range in pyproject.toml (torch>=2.4) is already satisfied and pip does not pull a multi-GB CUDA
# build.  An existing torch (CPU or CUDA, >= 2.4) is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[install] no torch found: installing the CPU build torch==2.13.0"
    "$PY" -m pip install -q "torch==2.13.0"
fi
extras="fast"
if [ "${1:-}" = "test" ]; then
    extras="fast,test,crosscheck"
fi
"$PY" -m pip install -q -e ".[${extras}]"
"$PY" -c "import torch, kvbuffer_ref; print(f'[install] kvbuffer {kvbuffer_ref.__version__}, torch {torch.__version__}')"
