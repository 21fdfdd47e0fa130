set -x
T0=$(date +%s)
mkdir -p /tmp/fi-parts && cp .whl-fi/p1/site.tar.xz.part0 /tmp/fi-parts/ &
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/fla_core-0.6.0-py3-none-any.whl
export PYTHONPATH=$(pwd):/tmp/site PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/tc
R=$OUT/v; mkdir -p $R
V="python -m kvbuffer.cli validate"
(nvidia-smi --query-gpu=name,driver_version --format=csv; python -c "import torch,triton,fla,transformers,sys;print(sys.version.split()[0],torch.__version__,triton.__version__,fla.__version__,transformers.__version__)") > $R/env.txt 2>&1
L=250
for dt in float16 float32 bfloat16; do
  timeout $L $V --impl hf --ops chunk --dtype $dt --device cuda --profile gpu --seed 11 --no-shrink --json $R/hf-chunk-$dt.json > $R/hf-chunk-$dt.txt 2>&1 &
done
timeout $L python bench/results/h100-2026-12-07-peers/hfdiag.py > $R/hfdiag.json 2> $R/hfdiag.err &
for dt in float32 bfloat16; do
  timeout $L $V --impl fast --ops chunk,chunk_varlen,decode,verify_chain --dtype $dt --device cuda --profile gpu --seed 11 --json $R/fast-$dt.json > $R/fast-$dt.txt 2>&1 &
done
wait
echo "done $(( $(date +%s) - T0 )) s" >> $R/env.txt
cat $R/env.txt; grep -hE "PASS|FAIL|NOT RUN" $R/*.txt | head -60; cat $R/hfdiag.json | head -30
ls -la /tmp/fi-parts
