#!/usr/bin/env bash
# the full runner (the report) on the final tree, then the compiled tests and the validator's verify lanes side by side
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fla_core-0.6.0-py3-none-any.whl
export PYTHONPATH=$(pwd):/tmp/site TRITON_CACHE_DIR=/tmp/kvbuffer-triton-cache
mkdir -p /tmp/v
timeout 300 python3 -m bench.gpu --out $OUT/latest --budget-s 285 --peer-path .whl/replayssm > /tmp/v/runner.log 2>&1; echo "runner rc=$?" >> /tmp/v/runner.log
grep -E "^(pool_round|pool_round_cycle|round_cycle|replayssm_round|replayssm_round_cycle|pool_decode|buffered_decode|replayssm_decode|verify|tree_round) +B=|rc=|!!|failures" /tmp/v/runner.log | cut -c1-100
V() { local name=$1; shift; OMP_NUM_THREADS=2 timeout ${LIM:-240} python3 -m kvbuffer_ref.validate.cli validate --device cuda --profile gpu --max-examples 2 --impl fast "$@" --json /tmp/v/$name.json > /tmp/v/$name.log 2>&1; echo "rc=$?" >> /tmp/v/$name.log; }
LIM=250 V vchain32 --ops verify_chain --dtype float32 &
LIM=250 V vtree32 --ops verify_tree --dtype float32 &
LIM=250 V vchain16 --ops verify_chain --dtype bfloat16 &
LIM=250 V vtree16 --ops verify_tree --dtype bfloat16 &
( OMP_NUM_THREADS=2 timeout 245 python3 -m pytest tests/pool/test_pool_fast.py tests/pool/test_pool_gpu.py tests/property/test_fast_verify.py tests/kernels/test_fast_lowp_state.py -q -p no:cacheprovider -n 6 > /tmp/v/tests.log 2>&1; echo "rc=$?" >> /tmp/v/tests.log ) &
wait
for f in /tmp/v/vchain32.log /tmp/v/vtree32.log /tmp/v/vchain16.log /tmp/v/vtree16.log /tmp/v/tests.log; do echo "== $f"; grep -v "^  \.\.\." $f | grep -E "kvbuffer_fast|FAIL|PASS|passed|failed|rc=|raised|Error" | cut -c1-200 | head -12; done | tee $OUT/summary.txt
python3 -c "import torch, triton, json; print(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)))" | tee -a $OUT/summary.txt
mkdir -p $OUT/logs; cp /tmp/v/*.log /tmp/v/*.json $OUT/logs/ 2>/dev/null
