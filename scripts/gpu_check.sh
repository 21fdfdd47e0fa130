#!/usr/bin/env bash
# The whole GPU check in one device call (docs/benchmarks.md):
#
#   bash scripts/gpu_check.sh OUTDIR [--before DIR]     (the fla wheel in .whl/; DIR: an older package root)
#
# 1. the kernel tests compiled on the GPU (tests/property/test_fast_*.py, tests/kernels; -n 8);
# 2. kvbuffer validate --device cuda on the bundled implementations;
# 3. compute-sanitizer (memcheck over scripts/sanitize.py's edge shapes, racecheck over its --quick set);
# 4. the GPU runner (python3 -m bench.gpu) into OUTDIR/latest (gpu.json, report.md, latency.png).
# Each stage has its own time limit (together under the device's 10 minutes a call; the runner under 5: it takes about 130 s for two package roots);
# a failing stage is reported and the later ones still run.  Prints one JSON line last: the device, the
# torch and triton versions, each stage's exit status and seconds, and the runner's JSON path.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:?give an output dir}
shift
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "gpu_check: installing .whl/*.whl failed: the fla rows will be skipped"
fi
export PYTHONPATH=$(pwd):/tmp/site:${PYTHONPATH:-}
STATUS=()
stage() {  # stage NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local s=$(date +%s)
  echo "=== $name (limit ${limit} s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUTDIR/$name.log" | tail -n 30
  STATUS+=("\"$name\": {\"exit\": ${PIPESTATUS[0]}, \"seconds\": $(( $(date +%s) - s ))}")
}
stage tests 150 python3 -m pytest tests/property/test_fast_decode.py tests/property/test_fast_verify.py tests/kernels -q -p no:cacheprovider -n 8
CLI=kvbuffer_ref.validate.cli; [ -f kvbuffer_ref/validate/cli.py ] || CLI=kvbuffer_ref.cli  # the `kvbuffer` command
stage validate 120 python3 -m $CLI validate --device cuda --max-examples 3
if command -v compute-sanitizer >/dev/null; then
  stage memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize.py
  stage racecheck 120 compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitize.py --quick
else
  echo "gpu_check: compute-sanitizer not on PATH: memcheck/racecheck not run"
fi
stage runner 270 python3 -m bench.gpu --out "$OUTDIR/latest" --budget-s 240 "$@"
python3 - "$OUTDIR" "{$(IFS=,; echo "${STATUS[*]}")}" <<'PY'
import json, sys, torch, triton
out, stages = sys.argv[1], json.loads(sys.argv[2])
print(json.dumps(dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                      torch=torch.__version__, triton=triton.__version__, stages=stages,
                      runner_json=f"{out}/latest/gpu.json")))
sys.exit(any(s["exit"] for s in stages.values()))
PY
