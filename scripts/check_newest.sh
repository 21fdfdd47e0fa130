#!/usr/bin/env bash
# Try the newest versions the extras allow, before a user does: a fresh venv, the package with its extras
# [fast,test,crosscheck,hf] installed WITHOUT constraints.txt (so pip takes the newest release of each
# dependency inside the ranges pyproject.toml declares), then the tests that follow other projects' code:
# tests/integrations (HF models through the pool), tests/crosscheck (fla and HF's torch fallbacks) and
# examples/generate.py against transformers' own tokens.  Run it on a schedule (weekly, say) and before
# widening a range in pyproject.toml.
#
#   bash scripts/check_newest.sh                      the newest allowed versions
#   bash scripts/check_newest.sh --pin transformers==5.17.0   one package held at a version (the range's bottom)
#   bash scripts/check_newest.sh --write               ... and, when everything passed, write the venv's
#                                                      versions to constraints.txt (then run the whole suite
#                                                      with them: bash scripts/install.sh test && pytest)
#
# Exit status: 0 when every test passed, 1 otherwise.  The venv is made under $TMPDIR and removed.
set -euo pipefail
cd "$(dirname "$0")/.."
write=0
pins=()
while [ $# -gt 0 ]; do
    case "$1" in
        --write) write=1 ;;
        --pin) shift; pins+=("$1") ;;
        *) echo "usage: bash scripts/check_newest.sh [--write] [--pin PKG==VERSION]..." >&2; exit 2 ;;
    esac
    shift
done
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
start=$(date +%s)
"${PYTHON:-python3}" -m venv "$venv"
PY="$venv/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
PYTHON="$PY" bash scripts/install.sh torch
"$PY" -m pip install -q -e ".[fast,test,crosscheck,hf]" "${pins[@]}"
echo "[check_newest] installed in $(( $(date +%s) - start )) s:"
"$PY" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|triton|transformers|fla-core|hypothesis|numpy|kernels|huggingface.hub|tokenizers)==' | sed 's/^/  /'
rc=0
"$PY" -m pytest tests/integrations tests/crosscheck -q -p no:cacheprovider -n auto || rc=1
"$PY" examples/generate.py --model qwen3_next --drafter tree || rc=1
if [ $rc -eq 0 ] && [ $write -eq 1 ]; then
    { sed -n '/^#/p' constraints.txt
      "$PY" -m pip freeze --exclude-editable | grep -viE '^(torch|kvbuffer|pip|setuptools|wheel)([=@ ]|$)'; } > constraints.txt.new
    mv constraints.txt.new constraints.txt
    echo "[check_newest] constraints.txt written; run the whole suite with it before committing"
fi
echo "[check_newest] $([ $rc -eq 0 ] && echo passed || echo FAILED) in $(( $(date +%s) - start )) s"
exit $rc
