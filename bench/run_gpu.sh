#!/usr/bin/env bash
# One command on the GPU machine: benchmark JSON + Markdown report + plots (docs/benchmarks.md).
#
#   bash bench/run_gpu.sh [OUTDIR]        (default: $OUT if set, else bench/results/latest)
#
# Writes OUTDIR/results.json, OUTDIR/report.md, 5 PNG plots and OUTDIR/run.log (8 files), and ends
# with a short summary table.  Fails (non-zero exit) when CUDA is missing, when any benchmark fails
# its oracle check or errors, or when the report cannot be built; the report is still written from
# the rows that passed, and it lists the failures.  Expected duration on one H200: ~3-5 minutes.
# Env overrides (quicker runs): KVBUFFER_BENCH_BATCHES=64,256 KVBUFFER_BENCH_CAPACITIES=16,64
# KVBUFFER_BENCH_DRAFTS=1,4,8 KVBUFFER_BENCH_TREE_DRAFTS=4,8 KVBUFFER_BENCH_VERIFY_BATCHES=64
# KVBUFFER_BENCH_ROUNDS=3 KVBUFFER_BENCH_REP_MS=50; BEFORE=old.json adds a before/after table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-bench/results/latest}}
mkdir -p "$OUTDIR" || { echo "run_gpu: cannot create $OUTDIR" >&2; exit 2; }
LOG="$OUTDIR/run.log"
: > "$LOG"
say() { echo "run_gpu: $*" | tee -a "$LOG"; }
start=$(date +%s)
# KVBUFFER_BENCH=smoke runs this same script on a CPU (interpreter, tiny shapes) to test the script itself
export PYTHONUNBUFFERED=1 KVBUFFER_BENCH=${KVBUFFER_BENCH:-gpu}

# flash-linear-attention 0.6.0 from the carried wheel (the fla rows are skipped, with the reason, without it)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || say "WARNING: installing .whl/*.whl failed (see $LOG)"
else
  say "WARNING: no .whl/*.whl: fla rows will be skipped"
fi
export PYTHONPATH=$(pwd):${PYTHONPATH:-}

python3 - <<'EOF' 2>&1 | tee -a "$LOG" || { echo "run_gpu: environment check failed" >&2; exit 2; }
import os, sys, torch, triton
if os.environ["KVBUFFER_BENCH"] == "gpu" and not torch.cuda.is_available():
    sys.exit("run_gpu: no CUDA device visible to torch")
import pytest_benchmark, matplotlib  # noqa: F401  (both on the GPU image)
try:
    import fla; fv = fla.__version__
except Exception as e:
    fv = f"unavailable ({type(e).__name__})"
dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke)"
print(f"run_gpu: {dev} torch {torch.__version__} triton {triton.__version__} fla {fv}")
EOF

say "benchmarks -> $OUTDIR/results.json"
python3 -m pytest bench/ -p no:cacheprovider -q -rfEs --benchmark-json "$OUTDIR/results.json" \
  --benchmark-columns=median,rounds --benchmark-sort=name 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
say "pytest exit $rc after $(( $(date +%s) - start )) s"

if [ ! -s "$OUTDIR/results.json" ]; then
  say "FAILED: no results.json written"
  exit 1
fi
BEFORE_ARGS=()
[ -n "${BEFORE:-}" ] && BEFORE_ARGS=(--before "$BEFORE")
python3 -m bench.report "$OUTDIR/results.json" "${BEFORE_ARGS[@]}" --out "$OUTDIR" 2>&1 | tee -a "$LOG"
rrc=${PIPESTATUS[0]}
[ $rrc -eq 0 ] || say "FAILED: report generator exit $rrc"
say "done in $(( $(date +%s) - start )) s; files: $(cd "$OUTDIR" && ls | tr '\n' ' ')"
if [ $rc -ne 0 ]; then say "FAILED: pytest exit $rc (failed benchmarks are listed above and in report.md)"; exit $rc; fi
exit $rrc
