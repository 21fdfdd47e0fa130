set -x
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/fla_core-0.6.0-py3-none-any.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/tf525 .whl2/transformers-5.25.0-py3-none-any.whl
export PYTHONPATH=$(pwd):/tmp/site PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/tc
R=$OUT/k4; mkdir -p $R
V="python -m kvbuffer.cli validate --report precision --state-dtype float32,bfloat16 --models all --steps 256 --device cuda"
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/env.txt 2>&1
L=165
timeout $L python bench/results/h100-2026-12-07-peers/hfdiag.py > $R/hfdiag-image.json 2> $R/hfdiag-image.err &
PYTHONPATH=/tmp/tf525:$PYTHONPATH timeout $L python bench/results/h100-2026-12-07-peers/hfdiag.py > $R/hfdiag-525.json 2> $R/hfdiag-525.err &
timeout $L $V --impl reference --impl fast --json $R/prec-ours.json > $R/prec-ours.md 2>&1 &
timeout $L $V --impl fla --json $R/prec-fla.json > $R/prec-fla.md 2>&1 &
timeout $L $V --impl hf --json $R/prec-hf.json > $R/prec-hf.md 2>&1 &
timeout $L $V --impl sglang-packed --peer-path .sgl-tree --json $R/prec-sglang.json > $R/prec-sglang.md 2>&1 &
timeout $L $V --impl vllm-packed --peer-path .vllm-tree --json $R/prec-vllm.json > $R/prec-vllm.md 2>&1 &
wait
echo "all done $(( $(date +%s) - T0 )) s" >> $R/env.txt
cat $R/hfdiag-image.json $R/hfdiag-525.json; ls -la $R
cd $OUT && tar czf k4.tgz k4 && rm -rf k4
