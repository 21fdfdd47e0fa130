T0=$(date +%s)
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 MKL_NUM_THREADS=4 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=$OUT/v; mkdir -p $R
V="python -m kvbuffer.cli validate"
(nvidia-smi --query-gpu=name,driver_version --format=csv; python -c "import torch,triton,sys;print(sys.version.split()[0],torch.__version__,triton.__version__)"; git log -1 --format=%h) > $R/env.txt 2>&1
L=${L:-520}
timeout $L $V --impl fast --ops chunk --dtype float32 --device cuda --profile gpu --seed 11 --json $R/fast-chunk-float32.json > $R/fast-chunk-float32.txt 2>&1 &
timeout $L $V --impl fast --ops chunk_varlen --dtype float32 --device cuda --profile gpu --seed 11 --json $R/fast-chunk_varlen-float32.json > $R/fast-chunk_varlen-float32.txt 2>&1 &
timeout $L $V --impl fast --ops direct,prefill --dtype float32 --device cuda --profile gpu --seed 11 --json $R/fast-direct-prefill-float32.json > $R/fast-direct-prefill-float32.txt 2>&1 &
wait
echo "done $(( $(date +%s) - T0 )) s" >> $R/env.txt
cat $R/env.txt; for f in $R/*.txt; do echo "== $f"; grep -v "^  \.\.\." $f | cut -c1-1500 | head -24; done
