T0=$(date +%s)
mkdir -p /tmp/fi-parts && cp .whl-fi/p1/site.tar.xz.part0 /tmp/fi-parts/ 2>/dev/null
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 MKL_NUM_THREADS=4 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=$OUT/s; mkdir -p $R
(nvidia-smi --query-gpu=name,driver_version --format=csv; python -c "import torch,triton,sys;print(sys.version.split()[0],torch.__version__,triton.__version__)"; git log -1 --format=%h) > $R/env.txt 2>&1
timeout 300 python -m kvbuffer.cli validate --impl fast --ops prefill --dtype float32 --device cuda --profile gpu --seed 11 --json $R/fast-prefill-float32.json > $R/fast-prefill-float32.txt 2>&1 &
i=0
for S in "" "decode.BV=128" "decode.BV=128 decode.NS=2" "decode.BV=128 decode.KB=64" "decode.BV=128 decode.KB=16" "decode.BV=128 decode.num_warps=8" "decode.BV=128 decode.KB=64 decode.NS=2" "decode.BV=128 decode.fold_BV=128" "decode.BV=128 decode.KB=16 decode.NS=2" "" "decode.BV=128"; do
  i=$((i+1)); A=""; for s in $S; do A="$A --set $s"; done
  echo "== [$S]" >> $R/sweep.txt
  timeout 100 python -m bench.gpu --ops buffered_decode_bf16 --batches 64,256,512 $A --out $R/run$i --budget-s 90 2>&1 | grep -E "^buffered_decode" >> $R/sweep.txt
done
for S in "" "decode.BV=128"; do A=""; for s in $S; do A="$A --set $s"; done
  echo "== fp32 [$S]" >> $R/sweep.txt
  timeout 100 python -m bench.gpu --ops buffered_decode --batches 64,256,512 $A --out $R/f$i --budget-s 90 2>&1 | grep -E "^buffered_decode" >> $R/sweep.txt; i=$((i+1))
done
wait
rm -rf $R/run* $R/f*
echo "done $(( $(date +%s) - T0 )) s" >> $R/env.txt
cat $R/env.txt $R/sweep.txt; grep -v "^  \.\.\." $R/fast-prefill-float32.txt | cut -c1-1200 | head -30
