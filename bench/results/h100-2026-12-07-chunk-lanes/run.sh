T0=$(date +%s)
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=$OUT/v; mkdir -p $R
V="python -m kvbuffer.cli validate"
(nvidia-smi --query-gpu=name,driver_version --format=csv; python -c "import torch,triton,transformers,sys;print(sys.version.split()[0],torch.__version__,triton.__version__,transformers.__version__)") > $R/env.txt 2>&1
L=${L:-420}
for dt in float32 bfloat16; do
  timeout $L $V --impl fast --ops chunk --dtype $dt --device cuda --profile gpu --seed 11 --json $R/fast-chunk-$dt.json > $R/fast-chunk-$dt.txt 2>&1 &
done
timeout $L $V --impl hf --ops chunk --dtype float16 --device cuda --profile gpu --seed 11 --no-shrink --json $R/hf-chunk-float16.json > $R/hf-chunk-float16.txt 2>&1 &
wait
echo "done $(( $(date +%s) - T0 )) s" >> $R/env.txt
cat $R/env.txt; for f in $R/*.txt; do echo "== $f"; grep -v "^  \.\.\." $f | cut -c1-2500 | head -30; done
