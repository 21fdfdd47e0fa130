#!/usr/bin/env bash
# Install kvbuffer from this checkout into the current Python environment ($PYTHON, default python3).
#   bash scripts/install.sh          torch (see below), then the package (editable) with Triton: extra [fast]
#   bash scripts/install.sh test     ... with the extras [fast,test,crosscheck] (pytest, hypothesis, fla-core, ...)
#                                    at the versions in constraints.txt (what the suite last passed with);
#                                    KVBUFFER_CONSTRAINTS=none takes the newest the extras allow instead
#   bash scripts/install.sh torch    only torch, by the rule below (scripts/check_wheel.sh uses it)
# PyTorch: an importable torch (CPU or CUDA, >= 2.4) is kept as it is.  Otherwise torch is installed
# BEFORE the package, because pip would resolve the package's torch>=2.4 to PyPI's default build, a CUDA
# build with its nvidia packages (several GB), also on a machine without a GPU:
#   $KVBUFFER_TORCH set        pip install $KVBUFFER_TORCH   (e.g. "torch==2.11.0", or "torch" for CUDA)
#   an NVIDIA GPU (nvidia-smi) pip install torch             (PyPI's default: the CUDA build)
#   no GPU, a local CPU wheel  pip install torch==2.13.0     (a CPU build on this machine's disk)
#   no GPU otherwise           pip install torch --index-url https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOCAL_CPU_TORCH="torch==2.13.0"

install_torch() {
    if "$PY" -c "import torch" >/dev/null 2>&1; then
        echo "[install] keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
        return
    fi
    if [ -n "${KVBUFFER_TORCH:-}" ]; then
        echo "[install] torch: $KVBUFFER_TORCH (KVBUFFER_TORCH)"
        "$PY" -m pip install -q $KVBUFFER_TORCH
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "[install] torch: an NVIDIA GPU is present, installing PyPI's CUDA build"
        "$PY" -m pip install -q torch
    else
        local tmp
        tmp=$(mktemp -d)
        if "$PY" -m pip download -q --no-deps --no-index -d "$tmp" "$LOCAL_CPU_TORCH" >/dev/null 2>&1 \
            && "$PY" -c "import sys, glob; sys.exit(0 if any('+cpu' in f for f in glob.glob('$tmp/torch-*.whl')) else 1)"; then
            echo "[install] torch: no GPU, installing the local CPU build $LOCAL_CPU_TORCH"
            "$PY" -m pip install -q "$tmp"/torch-*.whl
        else
            echo "[install] torch: no GPU, installing the CPU build from PyTorch's CPU index"
            "$PY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
        fi
        rm -rf "$tmp"
    fi
}

install_torch
case "${1:-}" in
    torch) exit 0 ;;
    test) extras="fast,test,crosscheck" ;;
    "") extras="fast" ;;
    *) echo "usage: bash scripts/install.sh [test|torch]" >&2; exit 2 ;;
esac
constraints=()
if [ "${1:-}" = test ] && [ "${KVBUFFER_CONSTRAINTS:-constraints.txt}" != none ]; then
    file=${KVBUFFER_CONSTRAINTS:-constraints.txt}
    [ -f "$file" ] || { echo "[install] constraints file $file not found" >&2; exit 2; }
    kept=$(mktemp)
    trap 'rm -f "$kept"' EXIT
    if "$PY" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)"; then
        # a CUDA build of torch pins the triton it was built with: keep that one
        grep -v '^triton==' "$file" > "$kept"
    else
        cp "$file" "$kept"
    fi
    constraints=(-c "$kept")
    echo "[install] test versions from $file"
fi
"$PY" -m pip install -q -e ".[${extras}]" "${constraints[@]}"
"$PY" -c "import torch, kvbuffer_ref; print(f'[install] kvbuffer {kvbuffer_ref.__version__}, torch {torch.__version__}')"
