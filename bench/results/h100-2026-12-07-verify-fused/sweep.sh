export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 TRITON_CACHE_DIR=/tmp/tc
R=$OUT/c1; mkdir -p $R; T0=$(date +%s); B=${BUDGET:-540}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader > $R/sweep.txt
python -c "import torch,triton;print(torch.__version__,triton.__version__)" >> $R/sweep.txt
left() { echo $(( B - ($(date +%s) - T0) )); }
echo "== tests (fused, compiled)" >> $R/sweep.txt
timeout 100 python -m pytest tests/property/test_fast_verify.py tests/kernels/test_fast_lowp_state.py -k "fused or tma or qk16 or pool_ops" -q -p no:cacheprovider -x > $R/tests.txt 2>&1; tail -4 $R/tests.txt >> $R/sweep.txt
run() { # label, ops, sets...
  lab=$1; ops=$2; shift 2; A=""; for s in "$@"; do A="$A --set $s"; done
  l=$(left); [ $l -lt 40 ] && { echo "stop before [$lab]" >> $R/sweep.txt; return; }
  echo "== [$lab] $* $(( $(date +%s) - T0 )) s" >> $R/sweep.txt
  timeout $l python -m bench.gpu --ops $ops --batches 64,256 --peer-path .rssm-tree $A --out /tmp/r-$lab --budget-s $(( l - 10 )) > /tmp/l-$lab.txt 2>&1; grep -E "^ *[0-9]+ |µs|rror|FAIL|Traceback|past budget" /tmp/l-$lab.txt | tail -30 >> $R/sweep.txt
}
run f1 round_cycle_fold,round_cycle_fold_bf16,pool_round_cycle_fold,verify verify.fused=True
run f0 round_cycle_fold,pool_round_cycle_fold,verify,replayssm_round_cycle
l=$(left); if [ $l -gt 80 ]; then echo "== vbreak $(( $(date +%s) - T0 )) s" >> $R/sweep.txt
OUT=$R timeout $(( l - 20 )) python .dbg/vbreak.py 64,256 >> $R/sweep.txt 2>&1; fi
run d1 buffered_decode,buffered_decode_bf16 decode.tma=True
run d0 buffered_decode,buffered_decode_bf16
l=$(left); if [ $l -gt 60 ]; then
echo "== A: rounds, before/after (verify XSPLIT=2 for a 16-bit state) $(( $(date +%s) - T0 )) s" >> $R/sweep.txt
timeout $l python -m bench.gpu --ops round_cycle_fold_bf16 --batches 64,256 --before .dbg/before --out /tmp/a --budget-s $(( l - 10 )) > $R/a.log 2>&1
grep -E "^ *[0-9]+ |µs|rror|FAIL|Traceback|past budget" $R/a.log | head -40 >> $R/sweep.txt
python - >> $R/sweep.txt 2>&1 <<'PY'
import json,os
j=json.load(open("/tmp/a/gpu.json"))
for r in j.get("before_after",[]): print("BA", r)
PY
fi
echo "done $(( $(date +%s) - T0 )) s" >> $R/sweep.txt
cat $R/sweep.txt
