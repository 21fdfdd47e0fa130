export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 TRITON_CACHE_DIR=/tmp/tc
R=$OUT/s; mkdir -p $R; T0=$(date +%s)
i=0
for S in "" "decode.dot=True" "decode.dot=True decode.BV=128" "decode.dot=True decode.NS=2" "decode.dot=True decode.KB=16" "decode.dot=True decode.num_warps=4"; do
  i=$((i+1)); A=""; for s in $S; do A="$A --set $s"; done
  left=$(( ${BUDGET:-300} - ($(date +%s) - T0) )); [ $left -lt 30 ] && { echo "stop before [$S]" >> $R/sweep.txt; break; }
  echo "== [$S]" >> $R/sweep.txt
  OPS=buffered_decode; [ $i = 1 ] && OPS=read_state,buffered_decode,buffered_decode_bf16
  timeout $left python -m bench.gpu --ops $OPS --batches 64,128,256,512 $A --out /tmp/run$i --budget-s $(( left - 10 )) 2>&1 | grep -E "^buffered_decode|^read_state|rror|FAIL" >> $R/sweep.txt
done
echo "done $(( $(date +%s) - T0 )) s" >> $R/sweep.txt
cat $R/sweep.txt
