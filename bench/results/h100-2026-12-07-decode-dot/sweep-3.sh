T0=$(date +%s)
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 TRITON_CACHE_DIR=/tmp/tc
R=$OUT/s; mkdir -p $R
i=0
for S in "" "decode.dot=True decode.scd=False" "decode.dot=True decode.scd=False decode.num_warps=1" "decode.dot=True decode.scd=False decode.num_warps=1 decode.NS=2" "decode.dot=True decode.num_warps=1 decode.NS=2" "decode.dot=True decode.scd=False decode.NS=3" "decode.dot=True decode.scd=False decode.num_warps=1 decode.KB=64" "decode.dot=True decode.num_warps=1 decode.KB=64 decode.NS=2"; do
  i=$((i+1)); A=""; for s in $S; do A="$A --set $s"; done
  left=$(( ${BUDGET:-400} - ($(date +%s) - T0) )); [ $left -lt 30 ] && { echo "stop before [$S]" >> $R/sweep.txt; break; }
  echo "== [$S]" >> $R/sweep.txt
  timeout $left python -m bench.gpu --ops buffered_decode_bf16 --batches 64,128,256,512 $A --out /tmp/run$i --budget-s $(( left - 10 )) 2>&1 | grep -E "^buffered_decode|rror|FAIL" >> $R/sweep.txt
done
echo "done $(( $(date +%s) - T0 )) s" >> $R/sweep.txt
cat $R/sweep.txt
