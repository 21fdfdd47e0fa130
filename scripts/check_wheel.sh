#!/usr/bin/env bash
# The first hour of a pip user, tried for real: build the wheel from this working tree, install it into a
# fresh virtual environment (a plain venv: nothing from the system's site-packages), and run there, outside
# any checkout, what the README tells a new user to run.
#   bash scripts/check_wheel.sh            the quick subset of kvbuffer validate (a few minutes on 2 cores)
#   FULL=1 bash scripts/check_wheel.sh     ... and the whole default `kvbuffer validate`, timed
# torch is installed first by scripts/install.sh's rule (the CPU build on a machine without a GPU), and the
# check fails if the wheel then pulls any nvidia package on such a machine.  Prints one line per check and
# "check_wheel: OK" at the end; exits non-zero on the first failure.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
step() { echo "[check_wheel] $*"; }

step "building the wheel from the working tree"
mkdir -p "$work/src"
(cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -cf - -T - ) | tar -xf - -C "$work/src"
"$PY" -m pip wheel -q --no-deps "$work/src" -w "$work/wheel"
wheel=$(ls "$work"/wheel/kvbuffer-*.whl)
"$PY" - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
golden = [n for n in names if n.startswith("kvbuffer/golden/data/")]
assert "kvbuffer/golden/data/index.json" in golden and len(golden) > 10, golden
print(f"[check_wheel] {sys.argv[1].rsplit('/', 1)[-1]}: {len(names)} files, {len(golden)} of them golden vectors")
EOF

step "a fresh venv; torch by scripts/install.sh's rule, then the wheel with [fast,test]"
"$PY" -m venv "$work/venv"
V="$work/venv/bin/python"
PYTHON="$V" bash "$ROOT/scripts/install.sh" torch
"$V" -m pip install -q "${wheel}[fast,test]"
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
    if "$V" -m pip list 2>/dev/null | grep -i '^nvidia-'; then
        echo "[check_wheel] FAIL: CUDA packages were installed on a machine without a GPU" >&2
        exit 1
    fi
    step "no nvidia package installed ($("$V" -c 'import torch; print("torch", torch.__version__)'))"
fi
du -sh "$work/venv" | sed 's/^/[check_wheel] venv size: /'

cd "$work"  # outside the checkout: only the installed package is importable
export KVBUFFER_CACHE_DIR="$work/cache"
KV="$work/venv/bin/kvbuffer"
unset PYTHONPATH
step "$("$KV" --version)"
"$V" -c "import kvbuffer_ref, sys; assert '$work/venv' in kvbuffer_ref.__file__, kvbuffer_ref.__file__"

step "kvbuffer validate (quick subset: the reference and the Triton kernels, 3 examples per lane)"
t0=$(date +%s)
"$KV" validate --ops recurrent,recurrent_decode,direct,decode[u],verify_chain[u] --max-examples 3 --seed 1 \
    --json "$work/quick.json" -q
step "quick subset passed in $(( $(date +%s) - t0 )) s"

step "kvbuffer report (the last run, as Markdown and a plot)"
"$KV" report > "$work/report-stdout.md"
grep -q "^# kvbuffer validate: PASSED" "$work/report-stdout.md"
"$KV" report "$work/quick.json" --out "$work/rep"
test -s "$work/rep/report.md" && test -s "$work/rep/quick-lanes.png"

step "the golden vectors from the installed wheel"
"$V" - <<'EOF'
import torch
from kvbuffer import golden
cases = golden.load_cases()
assert "site-packages" in str(golden.default_dir()), golden.default_dir()
reports = golden.check(ops=["decode", "verify_chain"])
bad = [r for r in reports if not r.passed]
assert not bad, bad
fast = golden.check(__import__("kvbuffer_ref"), ops=["flush"], dtype=torch.float32)
assert all(r.passed for r in fast)
print(f"[check_wheel] golden: {len(cases)} cases in {golden.default_dir()}; {len(reports) + len(fast)} checks passed")
EOF

step "the pytest plugin, as docs/validate-your-kernel.md runs it (an adapter module in a project folder)"
mkdir -p "$work/project"  # a folder of its own: pytest collects everything below where it starts
printf 'from kvbuffer_ref import direct_gated_delta_rule  # noqa: F401  (a module is an adapter)\nname = "my-adapter"\n' \
    > "$work/project/my_adapter.py"
# python3 -m pytest, not plain pytest: -m puts the working directory (the adapter module) on sys.path
(cd "$work/project" && "$V" -m pytest -q -p no:cacheprovider --kvbuffer-impl my_adapter --kvbuffer-ops direct \
    --kvbuffer-max-examples 2) > "$work/plugin.txt" 2>&1 || { cat "$work/plugin.txt"; exit 1; }
grep -q "1 passed" "$work/plugin.txt" && step "plugin: $(tail -1 "$work/plugin.txt")"

if [ "${FULL:-0}" = "1" ]; then
    step "the whole default kvbuffer validate, timed"
    t0=$(date +%s)
    "$KV" validate -q
    step "kvbuffer validate passed in $(( $(date +%s) - t0 )) s on $(nproc) cores"
fi
echo "check_wheel: OK"
