#!/usr/bin/env bash
# verify's phase 2: the state as the first MMA operand (wgmma, A in registers) and register caps
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fla_core-0.6.0-py3-none-any.whl
export PYTHONPATH=$(pwd):/tmp/site TRITON_CACHE_DIR=/tmp/kvbuffer-triton-cache
mkdir -p /tmp/v
for a in "SFIRST=False" "SFIRST=True" "SFIRST=True KB=16 NS=4 EARLY=True" "SFIRST=True BV=64"; do echo "aot $a: $(python3 scripts/aot_regs.py verify_stream XSPLIT=True XP=tf32 $a 2>&1 | tail -1 | cut -c1-110)"; done
B=64,128,256,512
R() { local name=$1 lim=$2; shift 2; timeout $lim python3 -m bench.gpu --out /tmp/v/$name --budget-s $((lim-10)) --batches $B "$@" > /tmp/v/$name.log 2>&1; echo "rc=$?" >> /tmp/v/$name.log; echo "== $name $*"; grep -E " B=|rc=|!!|error" /tmp/v/$name.log | cut -c1-150; }
R base 70 --ops verify,pool_round
R sf 70 --ops verify,pool_round --set verify.state_first=True
R sf_ns2 60 --ops verify,pool_round --set verify.state_first=True --set verify.NS=2
R sf_kb64 60 --ops verify,pool_round --set verify.state_first=True --set verify.KB=64 --set verify.NS=2
R sf_bv64 60 --ops verify,pool_round --set verify.state_first=True --set verify.BV=64
R mr96 60 --ops verify,pool_round --set verify.maxnreg=96
R sf_late 60 --ops verify,pool_round --set verify.state_first=True --set verify.early=False --set verify.KB=32 --set verify.NS=3
python3 -c "import torch, triton, json; print(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)))"
cp /tmp/v/*.log $OUT/ 2>/dev/null
