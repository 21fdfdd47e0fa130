#!/usr/bin/env bash
# The whole GPU check in one call (the device tool's H200: torch 2.11, triton 3.6, no network).
#
#   bash scripts/gpu_check.sh OUTDIR [STAGE...]    (the fla wheel must be in .whl/)
#
# STAGEs (default: all, in this order; the device tool allows 10 minutes a call, so split them
# over three calls: `decode verify`, `tests report`, `validate`; bench/results/h200_gpu_check/):
#
# 1. the fast property tests, compiled on the GPU (hypothesis profile 'gpu');
# 2. `kvbuffer validate --device cuda` on the bundled implementations;
# 3. bench/gpu_decode.py --tune: compiled checks at Qwen3-Next shapes, a launch-config sweep, then
#    recurrent / fla / buffered-decode timings against the measured copy bandwidth;
# 4. bench/gpu_verify.py: verify/accept checks, buffered vs per-draft-state vs fla, memory cross-check;
# 5. bench/run_gpu.sh: the pytest-benchmark suites (device time) and the Markdown report with plots;
# probe (not in the default list): bench/gpu_probe.py, where decode / verify time goes, per launch variant
# (PROBE_ARGS="--skip floor,verify" passes options to it);
# ncu (not in the default list): Nsight Compute counters of bench/ncu_targets.py's launches (ncu.txt).
# Everything lands in OUTDIR/gpu_results.tgz (one file: the device tool returns at most 8) and the
# summary is printed last.  Each stage has its own time limit; a failing stage is reported, the
# later stages still run, and the exit status is non-zero if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:?give an output dir}
shift
STAGES=${*:-tests validate decode verify report}
W=$(mktemp -d)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
status=()
t0=$(date +%s)
stage() {  # stage NAME LIMIT_S CMD...  (skipped unless NAME is in STAGES)
  local name=$1 limit=$2; shift 2
  case " $STAGES " in *" $name "*) ;; *) return 0;; esac
  local s=$(date +%s)
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$W/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$W/$name.log"
  status+=("$name: exit $rc in $(( $(date +%s) - s )) s")
}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || echo "WARNING: fla wheel not installed"
export PYTHONPATH=$(pwd):/tmp/site:${PYTHONPATH:-}
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv;
  python3 -c "import torch, triton, hypothesis; import fla; print('torch', torch.__version__, 'triton', triton.__version__, 'hypothesis', hypothesis.__version__, 'fla', fla.__version__, torch.cuda.get_device_name())"; } | tee "$W/env.txt"

stage tests 420 env HYPOTHESIS_PROFILE=gpu python3 -m pytest tests/property/test_fast_decode.py tests/property/test_fast_verify.py -q -p no:cacheprovider
stage validate 200 python3 -m kvbuffer_ref.cli validate --device cuda --impl reference --impl fast --impl fla --max-examples 5 --json "$W/validate.json"
stage decode 200 python3 -m bench.gpu_decode --tune --out "$W/gpu_decode.json"
stage verify 150 python3 -m bench.gpu_verify --quick --out "$W/gpu_verify.json"
stage report 400 bash bench/run_gpu.sh "$W/report"
stage probe 500 python3 -m bench.gpu_probe --out "$W/probe.json" ${PROBE_ARGS:-}
stage ncu 400 bash -c "\$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1) --clock-control none -k 'regex:${NCU_KERNELS:-_read_blocks|_decode|_fold|_book|_verify}' --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats \${NCU_EXTRA:-} python3 -m bench.ncu_targets > $W/ncu.txt 2>&1; rc=\$?; grep -E '^  _|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Stall|Warp Cycles Per Issued|Eligible Warps|Issued Warp|Block Limit|Waves Per SM|L2 Hit|Issue Slots|Executed Ipc|Executed Instructions|fold_launch|cycles being stalled|Pipe' $W/ncu.txt | head -400; exit \$rc"

tar czf "$OUTDIR/gpu_results_$(echo $STAGES | tr " " "_").tgz" -C "$W" .
echo "=== summary (total $(( $(date +%s) - t0 )) s)"
cat "$W/env.txt"
printf '%s\n' "${status[@]}"
for s in "${status[@]}"; do case "$s" in *"exit 0 "*) ;; *) exit 1;; esac; done
