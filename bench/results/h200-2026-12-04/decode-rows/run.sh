#!/usr/bin/env bash
# decode: the state sums by rows (each thread its columns, no cross-lane sums) against the tree before it; bf16 state; compiled tests
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fla_core-0.6.0-py3-none-any.whl
export PYTHONPATH=$(pwd):/tmp/site TRITON_CACHE_DIR=/tmp/kvbuffer-triton-cache
mkdir -p /tmp/v
for a in "" "state_ptr=*bf16"; do echo "aot [$a]: $(AOT_ALIGNED=1 python3 scripts/aot_regs.py decode $a 2>&1 | tail -1 | cut -c1-90)"; done
timeout 120 python3 -m bench.gpu --out $OUT/rows --budget-s 110 --batches 64,128,256,512 --peer-path .whl/replayssm --before .whl/before --ops read_state,buffered_decode,pool_decode,replayssm_decode > /tmp/v/rows.log 2>&1; echo "rc=$?" >> /tmp/v/rows.log
grep -E " B=|rc=|!!|failures" /tmp/v/rows.log | cut -c1-110
timeout 60 python3 scripts/gpu_lowp.py --sweep --batches 64,256 --storages state,state+u --budget-s 50 --out /tmp/v/sweep.json --candidates "table,KB=64" > /tmp/v/sweep.log 2>&1; echo "sweep rc=$?"
grep -E "B=|ERROR|WRONG" /tmp/v/sweep.log | cut -c1-120 | head -12
( OMP_NUM_THREADS=2 timeout 140 python3 -m pytest tests/property/test_fast_decode.py tests/pool/test_pool_fast.py tests/pool/test_pool_gpu.py tests/kernels/test_fast_lowp_state.py -q -p no:cacheprovider -n 10 > /tmp/v/tests.log 2>&1; echo "rc=$?" >> /tmp/v/tests.log )
tail -3 /tmp/v/tests.log; grep -E "^FAILED" /tmp/v/tests.log | head
python3 -c "import torch, triton, json; print(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)))"
cp /tmp/v/*.log /tmp/v/*.json $OUT/ 2>/dev/null
