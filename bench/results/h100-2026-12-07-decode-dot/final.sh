T0=$(date +%s)
mkdir -p /tmp/fi && test -d /tmp/fi/site || (cat /tmp/fi-parts/site.tar.xz.part0 .whl-fi/p2/site.tar.xz.part1 | xz -d | tar -x -C /tmp/fi) || echo "FI extract failed"
pip install -q --no-deps .whl/fla_core-0.6.0-py3-none-any.whl > /dev/null 2>&1
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 TRITON_CACHE_DIR=/tmp/tc
R=$OUT/f; mkdir -p $R
(nvidia-smi --query-gpu=name,driver_version --format=csv; python -c "import torch,triton,sys;print(sys.version.split()[0],torch.__version__,triton.__version__)"; PYTHONPATH=/tmp/fi/site python -c "import flashinfer; print('flashinfer', flashinfer.__version__)"; cat .rssm-tree/REVISION) > $R/env.txt 2>&1
timeout 400 python -m bench.gpu --ops read_state,recurrent_decode,fla_fused_recurrent,buffered_decode,buffered_decode_bf16,pool_decode,replayssm_decode,sglang_decode,flashinfer_decode,flashinfer_decode_bf16 --batches 64,128,256,512 --peer-path .rssm-tree --flashinfer-path /tmp/fi/site --sglang-path .sgl-tree --out $R/bench --budget-s 380 > $R/bench.txt 2>&1
echo "done $(( $(date +%s) - T0 )) s" >> $R/env.txt
rm -f $R/bench/latency.png
cat $R/env.txt; grep -v "^ *\.\.\." $R/bench.txt | tail -50
