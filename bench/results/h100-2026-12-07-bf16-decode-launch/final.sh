T0=$(date +%s)
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 TRITON_CACHE_DIR=/tmp/tc
R=$OUT/d; mkdir -p $R
(nvidia-smi --query-gpu=name,driver_version --format=csv; python -c "import torch,triton,sys;print(sys.version.split()[0],torch.__version__,triton.__version__)") > $R/env.txt 2>&1
timeout 150 python -m bench.gpu --ops read_state,buffered_decode,buffered_decode_bf16 --batches 64,128,256,512 --out $R/bench --budget-s 140 > $R/bench.txt 2>&1
echo "done $(( $(date +%s) - T0 )) s" >> $R/env.txt
cat $R/env.txt; grep -v "^ *\.\.\." $R/bench.txt | tail -40
