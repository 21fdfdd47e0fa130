T0=$(date +%s)
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 TRITON_CACHE_DIR=/tmp/tc
R=$OUT/s; mkdir -p $R
(nvidia-smi --query-gpu=name,driver_version --format=csv; python -c "import torch,triton,sys;print(sys.version.split()[0],torch.__version__,triton.__version__)"; git log -1 --format=%h) > $R/env.txt 2>&1
i=0
for S in "" "decode.dot=True" "decode.dot=True decode.NS=2" "decode.dot=True decode.NS=3" "decode.dot=True decode.KB=64 decode.NS=2" "decode.dot=True decode.num_warps=4 decode.NS=2" "decode.dot=True decode.BV=64 decode.NS=2" "decode.dot=True decode.KB=64"; do
  i=$((i+1)); A=""; for s in $S; do A="$A --set $s"; done
  left=$(( ${BUDGET:-420} - ($(date +%s) - T0) )); [ $left -lt 30 ] && { echo "stop before [$S]" >> $R/env.txt; break; }
  echo "== [$S]" >> $R/sweep.txt
  timeout $left python -m bench.gpu --ops buffered_decode,buffered_decode_bf16 --batches 64,256,512 $A --out $R/run$i --budget-s $(( left - 10 )) 2>&1 | grep -E "^buffered_decode|rror|FAIL" >> $R/sweep.txt
done
echo "done $(( $(date +%s) - T0 )) s" >> $R/env.txt
cat $R/env.txt $R/sweep.txt
