#!/usr/bin/env bash
# The GPU check in named stages (docs/benchmarks.md); a device call runs the stages it names:
#
#   bash scripts/gpu_check.sh OUTDIR [STAGES] [--before DIR] [--peer-path P]
#
# STAGES: a comma list (default: tests,validate,memcheck,racecheck,runner), from
#   tests      the kernel, pool and lowp tests compiled on the GPU (-n 8)
#   models     examples/generate.py through kvbuffer_fast's pool for each model (token equality; without fla
#              on the path; transformers 5 from .whl/hf if there: pip download --python-version 3.12
#              --only-binary=:all: --platform manylinux2014_x86_64 -d .whl/hf 'transformers>=5.17,<5.26')
#   validate   (limit VALIDATE_LIMIT s, default 540: a lane takes 2-5 minutes, mostly compiling, when the groups run
#              side by side)
#              kvbuffer validate --profile gpu --device cuda: kvbuffer_fast, fla, fla-pool, SGLang (and ReplaySSM with
#              --peer-path), one process per group of lanes side by side (4 CPU threads each), and
#              --report precision; each group's log and JSON in OUTDIR/validate-NAME.{log,json}; LANES=a,b
#              (group names as in validate() below, and precision) runs only those groups
#   memcheck, racecheck   compute-sanitizer over scripts/sanitize.py's edge shapes (racecheck: --quick)
#   runner     the benchmark runner (python3 -m bench.gpu) into OUTDIR/latest (--before DIR: an older root too;
#              sglang_decode times SGLang's packed decode from the wheel in .whl/sglang/, its default --sglang-path)
#   prefill    scripts/gpu_prefill.py --timings-only (the chunk kernels against fla)
#   lowp       scripts/gpu_lowp.py (bf16 state and cache: time and error growth)
#   tp         scripts/tp_nccl.py (NCCL with 2 GPUs, else --simulate on one)
# The fla wheel is installed from .whl/ when present.  Each stage has its own time limit; a failing stage
# is reported and the later ones still run.  Prints one JSON line last: the device, the torch and triton
# versions, each stage's exit status and seconds.
# Compiled kernels carry over between device calls: Triton's cache lives in $TRITON_CACHE_DIR (default
# /tmp/kvbuffer-triton-cache), is unpacked first from .triton-cache/cache.tgz when that file is there (carry
# .triton-cache, a folder .git/info/exclude ignores) and packed last into OUTDIR/triton-cache.tgz when it
# fits in what a device call returns (15 MiB); copying that file to .triton-cache/cache.tgz here makes the
# next call skip every compile whose kernel source, specialisation, Triton version and GPU are unchanged.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:?give an output dir}
shift
STAGES=tests,validate,memcheck,racecheck,runner
if [ $# -gt 0 ] && [[ $1 != --* ]]; then STAGES=$1; shift; fi
BEFORE=() PEER=()
while [ $# -gt 0 ]; do
  case $1 in
    --before) BEFORE=(--before "$2"); shift 2 ;;
    --peer-path) PEER=(--peer-path "$2"); shift 2 ;;
    *) echo "gpu_check: unknown argument $1"; exit 2 ;;
  esac
done
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if ls .whl/*.whl >/dev/null 2>&1; then
  # one install per machine: two instances of this script (e.g. tests and validate side by side) share it
  ( flock 9
    [ -e /tmp/site/.done ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && touch /tmp/site/.done; } \
    || echo "gpu_check: installing .whl/*.whl failed: the fla rows will be skipped" ) 9>/tmp/site.lock
fi
export PYTHONPATH=$(pwd):/tmp/site:${PYTHONPATH:-}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kvbuffer-triton-cache}
if [ -f .triton-cache/cache.tgz ]; then
  ( flock 9
    [ -e "$TRITON_CACHE_DIR/.unpacked" ] || { mkdir -p "$TRITON_CACHE_DIR" && tar -xzf .triton-cache/cache.tgz \
        -C "$TRITON_CACHE_DIR" && touch "$TRITON_CACHE_DIR/.unpacked" \
        && echo "gpu_check: Triton cache unpacked ($(find "$TRITON_CACHE_DIR" -type f ! -name .unpacked | wc -l) files)"; } \
    || echo "gpu_check: .triton-cache/cache.tgz did not unpack: compiling from scratch" ) 9>/tmp/triton-cache.lock
fi
STATUS=()
stage() {  # stage NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local s=$(date +%s)
  echo "=== $name (limit ${limit} s)"
  timeout "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUTDIR/$name.log"
  STATUS+=("\"$name\": {\"exit\": $rc, \"seconds\": $(( $(date +%s) - s ))}")
}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
models() {  # examples/generate.py through kvbuffer_fast's pool, under transformers from .whl/hf when there
  local rc=0 site=/tmp/site-hf whl wheels m
  whl=$(ls .whl/hf/transformers-*.whl 2>/dev/null | sort -V | tail -n 1)
  rm -rf "$site"
  if [ -n "$whl" ]; then
    # pip resolves the wheel against the machine's own packages: only what they lack, or hold at a version
    # transformers does not take, goes to $site (ahead on the path); numpy, torch and the rest stay the machine's
    python3 -m pip install -q --dry-run --no-index --find-links .whl/hf --report /tmp/site-hf.json "$whl" || return 1
    wheels=$(python3 -c 'import json, sys, urllib.parse as u
print("\n".join(u.unquote(u.urlparse(i["download_info"]["url"]).path) for i in json.load(open(sys.argv[1]))["install"]))' \
      /tmp/site-hf.json) || return 1
    if [ -n "$wheels" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" $wheels || return 1
    fi
  fi
  local -x PYTHONPATH=$(pwd):$site  # fla (/tmp/site) off the path: the models' own torch code is the reference
  python3 -c 'import numpy, torch, transformers; print("models: transformers", transformers.__version__, "from",
    transformers.__file__, "| numpy", numpy.__version__, "| torch", torch.__version__)' || return 1
  for m in qwen3_next qwen3_5 kimi_linear; do
    python3 examples/generate.py --model "$m" --device cuda --tokens 128 --drafter tree || rc=1
  done
  return $rc
}
# -v: each test's verdict as it ends, so a run cut by the limit still names its failures (grep FAILED)
has tests && stage tests "${TESTS_LIMIT:-300}" python3 -m pytest tests/property/test_fast_decode.py tests/property/test_fast_verify.py tests/property/test_engine_inputs.py \
  tests/kernels tests/pool -v -p no:cacheprovider -n 8 --dist loadgroup
has models && { export -f models; stage models 150 bash -c models; }
validate() {  # one process per group of lanes, side by side (compiling dominates; the GPU work is small)
  local pids=() rc=0 name
  local -x OMP_NUM_THREADS=4 MKL_NUM_THREADS=4  # torch's default (one thread per core) in each process starves the rest
  run_lanes() {  # NAME ARGS...: one kvbuffer validate process, its log and JSON named NAME (skipped unless in $LANES)
    local name=$1; shift
    [ -z "${LANES:-}" ] || [[ ",$LANES," == *",$name,"* ]] || return 0
    python3 -m kvbuffer.cli validate --device cuda --profile gpu --max-examples 2 "$@" \
      --json "$OUTDIR/validate-$name.json" > "$OUTDIR/validate-$name.log" 2>&1
  }
  run_lanes fast-prefill --impl fast --ops chunk,chunk_varlen,direct,prefill & pids+=($!)
  run_lanes fast-prefill-bf16 --impl fast --ops chunk,direct,prefill --dtype bfloat16 & pids+=($!)
  run_lanes fast-decode --impl fast --ops recurrent,recurrent_decode,recurrent_varlen,decode,flush,materialize & pids+=($!)
  run_lanes fast-verify --impl fast --ops verify_chain,verify_tree & pids+=($!)
  run_lanes fast-decode-16 --impl fast --ops recurrent,recurrent_decode,decode,flush,materialize --dtype bfloat16,float16 & pids+=($!)
  run_lanes fast-verify-16 --impl fast --ops verify_chain,verify_tree --dtype bfloat16,float16 & pids+=($!)
  run_lanes fla --impl fla & pids+=($!)
  run_lanes fla-16 --impl fla --dtype bfloat16,float16 & pids+=($!)
  run_lanes fla-chunk-tf32 --impl fla --ops chunk --contract tf32 --no-shrink & pids+=($!)
  run_lanes fla-varlen --impl fla --ops chunk_varlen & pids+=($!)
  run_lanes fla-pool --impl fla-pool & pids+=($!)
  # SGLang's GDN kernel files, read from its wheel in .whl/sglang/ (python3 -m pip download --no-deps sglang -d
  # .whl/sglang; not installed, so kept out of .whl/*.whl): NOT RUN rows when it is absent (docs/peers.md);
  # one process per kernel, float32 first (its budget is the finding), then the 16-bit lanes
  run_lanes sglang --impl sglang --peer-path .whl/sglang --dtype float32,bfloat16 & pids+=($!)
  run_lanes sglang-decode --impl sglang-decode --peer-path .whl/sglang --dtype float32,bfloat16 & pids+=($!)
  run_lanes sglang-packed --impl sglang-packed --peer-path .whl/sglang --dtype float32,bfloat16 & pids+=($!)
  run_lanes sglang-pool --impl sglang-pool --peer-path .whl/sglang --dtype float32,bfloat16 & pids+=($!)
  run_lanes sglang-chunk --impl sglang-chunk --peer-path .whl/sglang --dtype bfloat16,float16 & pids+=($!)
  run_lanes sglang-inputs --impl sglang-inputs --peer-path .whl/sglang --ops engine_inputs --dtype float32,bfloat16 & pids+=($!)
  if [ -z "${LANES:-}" ] || [[ ",$LANES," == *",precision,"* ]]; then
    python3 -m kvbuffer.cli validate --device cuda --report precision --impl fast --impl fla \
      "${PREC_PEER[@]}" --json "$OUTDIR/precision.json" > "$OUTDIR/precision.md" 2>&1 & pids+=($!)
  fi
  if [ ${#PEER[@]} -gt 0 ]; then
    run_lanes replayssm-decode --impl replayssm --ops recurrent,recurrent_decode,decode,flush,materialize & pids+=($!)
    run_lanes replayssm-verify --impl replayssm --ops verify_chain,verify_tree & pids+=($!)
  fi
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  for name in "$OUTDIR"/validate-*.log "$OUTDIR/precision.md"; do [ -e "$name" ] && { echo "--- $name"; tail -n 30 "$name"; }; done
  return $rc
}
PREC_PEER=()
if [ ${#PEER[@]} -gt 0 ]; then export KVBUFFER_PEER_PATH=${PEER[1]}; PREC_PEER=(--impl replayssm); fi
if has validate; then
  export -f validate; export OUTDIR
  stage validate "${VALIDATE_LIMIT:-540}" bash -c "PEER=(${PEER[*]}); PREC_PEER=(${PREC_PEER[*]}); validate"
fi
if has memcheck || has racecheck; then
  if command -v compute-sanitizer >/dev/null; then
    has memcheck && stage memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize.py
    has racecheck && stage racecheck 120 compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitize.py --quick
  else
    echo "gpu_check: compute-sanitizer not on PATH: memcheck/racecheck not run"
  fi
fi
has runner && stage runner 270 python3 -m bench.gpu --out "$OUTDIR/latest" --budget-s 240 "${BEFORE[@]}" "${PEER[@]}"
has prefill && stage prefill 200 python3 scripts/gpu_prefill.py --timings-only --budget-s 170 --out "$OUTDIR/prefill.json"
has lowp && stage lowp 170 python3 scripts/gpu_lowp.py --out "$OUTDIR/lowp.json"
has tp && stage tp 120 bash -c 'n=$(python3 -c "import torch;print(torch.cuda.device_count())"); if [ "$n" -ge 2 ]; then python3 scripts/tp_nccl.py; else python3 scripts/tp_nccl.py --simulate; fi'
if [ -d "$TRITON_CACHE_DIR" ]; then  # the compiled kernels, for the next call (carried as .triton-cache/cache.tgz)
  tar -czf "$OUTDIR/triton-cache.tgz" -C "$TRITON_CACHE_DIR" --exclude=.unpacked . 2>/dev/null
  size=$(stat -c %s "$OUTDIR/triton-cache.tgz" 2>/dev/null || echo 0)
  if [ "$size" -gt $((15 * 1024 * 1024)) ]; then
    echo "gpu_check: the Triton cache packs to $size bytes, past the 15 MiB a call returns: not kept"
    rm -f "$OUTDIR/triton-cache.tgz"
  else
    echo "gpu_check: Triton cache packed into $OUTDIR/triton-cache.tgz ($size bytes)"
  fi
fi
python3 - "$OUTDIR" "{$(IFS=,; echo "${STATUS[*]}")}" <<'PY'
import json, sys, torch, triton
out, stages = sys.argv[1], json.loads(sys.argv[2])
print(json.dumps(dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                      torch=torch.__version__, triton=triton.__version__, stages=stages)))
sys.exit(any(s["exit"] for s in stages.values()))
PY
