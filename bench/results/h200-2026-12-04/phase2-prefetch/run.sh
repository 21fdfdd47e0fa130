#!/usr/bin/env bash
# verify's phase 2 with the rows' next block loaded one trip ahead, against the tree before it (same run)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fla_core-0.6.0-py3-none-any.whl
export PYTHONPATH=$(pwd):/tmp/site TRITON_CACHE_DIR=/tmp/kvbuffer-triton-cache
mkdir -p /tmp/v
echo "aot: $(python3 scripts/aot_regs.py verify_stream XSPLIT=True XP=tf32 KB=16 NS=4 EARLY=True 2>&1 | tail -1 | cut -c1-100)"
echo "aot: $(python3 scripts/aot_regs.py verify_stream XSPLIT=True XP=tf32 2>&1 | tail -1 | cut -c1-100)"
timeout 280 python3 -m bench.gpu --out $OUT/prefetch --budget-s 270 --batches 64,128,256,512 --peer-path .whl/replayssm --before .whl/before --ops verify,pool_round,tree_round,pool_round_cycle,replayssm_round,replayssm_round_cycle > /tmp/v/pf.log 2>&1; echo "rc=$?" >> /tmp/v/pf.log
grep -E " B=|rc=|!!|after / before|failures" /tmp/v/pf.log | cut -c1-130
python3 -c "import torch, triton, json; print(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)))"
cp /tmp/v/pf.log $OUT/
