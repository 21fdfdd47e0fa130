#!/usr/bin/env bash
# decode: registers and launch variants (register caps), Nsight Compute of fp32 / bf16 state at B = 64
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fla_core-0.6.0-py3-none-any.whl
export PYTHONPATH=$(pwd):/tmp/site TRITON_CACHE_DIR=/tmp/kvbuffer-triton-cache
mkdir -p /tmp/v
for a in "" "maxnreg=64" "state_ptr=*bf16" "state_ptr=*bf16 maxnreg=64" "state_ptr=*bf16 KB=64" "state_ptr=*bf16 KB=64 maxnreg=96" "state_ptr=*bf16 NS=3 maxnreg=64"; do echo "aot [$a]: $(AOT_ALIGNED=1 python3 scripts/aot_regs.py decode $a 2>&1 | tail -1 | cut -c1-90)"; done
NCU=$(which ncu 2>/dev/null || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
if [ -n "$NCU" ]; then
timeout 200 $NCU --clock-control none --profile-from-start off -k regex:_decode_kernel --launch-count 8 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis python3 .whl/prof_decode.py 64 > $OUT/ncu-decode.txt 2>&1; echo "ncu rc=$?"
grep -E "_decode_kernel|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit Reg|Block Limit Shared|Warp Cycles Per Issued|Issued Warp|Eligible Warps|L1TEX|Local" $OUT/ncu-decode.txt | head -90
fi
timeout 200 python3 scripts/gpu_lowp.py --sweep --batches 64,256 --storages state --budget-s 185 --out /tmp/v/sweep.json --candidates "table,maxnreg=64,maxnreg=80,KB=64 maxnreg=96,NS=3 maxnreg=64,KB=64 NS=3 maxnreg=80" > /tmp/v/sweep.log 2>&1; echo "sweep rc=$?"
grep -E "B=|best|ERROR|WRONG" /tmp/v/sweep.log | cut -c1-140 | head -30
R() { local name=$1 lim=$2; shift 2; timeout $lim python3 -m bench.gpu --out /tmp/v/$name --budget-s $((lim-10)) --batches 64,128,256,512 "$@" > /tmp/v/$name.log 2>&1; echo "rc=$?" >> /tmp/v/$name.log; echo "== $name $*"; grep -E " B=|rc=|!!" /tmp/v/$name.log | cut -c1-150; }
R d64 60 --ops read_state,buffered_decode --set decode.maxnreg=64
R d80 50 --ops buffered_decode --set decode.maxnreg=80
python3 -c "import torch, triton, json; print(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)))"
cp /tmp/v/*.log /tmp/v/*.json $OUT/ 2>/dev/null
