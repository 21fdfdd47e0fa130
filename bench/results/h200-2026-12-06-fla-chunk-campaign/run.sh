# fla chunk campaign, resumable on a warm machine: bash ../.dbg/camp.sh PHASE LIMIT_S
set -x
PH=$1; LIM=$2
T0=$(date +%s)
cd .snap
[ -d /tmp/site/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site ../.whl/fla_core-0.6.0-py3-none-any.whl
export PYTHONPATH=$(pwd):/tmp/site PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TRITON_CACHE_DIR=/tmp/tc
C=/tmp/camp; mkdir -p $C
R=$OUT/p$PH; mkdir -p $R
(nvidia-smi --query-gpu=name,driver_version --format=csv; python -c "import torch,triton,fla,sys;print(sys.version.split()[0],torch.__version__,triton.__version__,fla.__version__)"; git -C .. log -1 --format=%H 2>/dev/null; cat /proc/cpuinfo | grep -c processor; date) > $R/env.txt 2>&1
[ -d /tmp/flacfg ] || python scripts/fla_fixed_configs.py /tmp/flacfg > $R/flacfg.txt 2>&1
L=$(( LIM - ($(date +%s) - T0) ))
HS="2,4,16,16;1,1,8,24"
for op in chunk chunk_varlen; do for dt in float32 float16 bfloat16; do for part in 0 1; do
  base=0; [ $op = chunk_varlen ] && base=100
  start=$((base + 50*part)); end=$((start + 50))
  name=$op-$dt-$part
  first=$start
  for j in $C/$name-*.json; do [ -f $j ] || continue
    n=$(python -c "import json,sys;d=json.load(open('$j'));print(d['first_seed']+d['seeds'])"); [ $n -gt $first ] && first=$n; done
  cnt=$((end - first)); [ $cnt -le 0 ] && continue
  FLA_CACHE_MODE=default FLA_CONFIG_DIR=/tmp/flacfg timeout $L python scripts/false_failures.py --device cuda --profile ci --impl fla --ops $op --dtype $dt --head-shapes "$HS" --seeds $cnt --first-seed $first --time-limit $((L-75)) --json $C/$name-$PH.json > $C/$name-$PH.txt 2>&1 &
done; done; done
if [ "$PH" = 1 ]; then
  for dt in float16 bfloat16; do
    KVBUFFER_PEER_PATH=../.vllm-tree timeout $L python ../.dbg/first_config.py -m kvbuffer.cli validate --impl vllm-chunk --peer-path ../.vllm-tree --device cuda --profile ci --seed 11 --dtype $dt --json $R/vllm-chunk-$dt.json > $R/vllm-chunk-$dt.txt 2>&1 &
  done
fi
if [ "$PH" = 1 ]; then

  timeout $L python -m kvbuffer.cli validate --impl sglang-decode --peer-path ../.sgl-tree --device cuda --profile gpu --seed 11 --dtype float32,float16 --json $R/sglang-decode.json > $R/sglang-decode.txt 2>&1 &
  timeout $L python -m kvbuffer.cli validate --impl hf --ops chunk --device cuda --profile gpu --seed 11 --json $R/hf-chunk.json > $R/hf-chunk.txt 2>&1 &
fi
if [ "$PH" = 2 ]; then
  (cd .. && cd .snap && KVBUFFER_PEER_PATH=../.vllm-tree timeout 200 python ../.dbg/first_config.py ../.dbg/vdiag.py > $R/vdiag.txt 2>&1) &
fi
wait
echo "phase $PH done $(( $(date +%s) - T0 )) s" >> $R/env.txt
cp $C/*-$PH.json $C/*-$PH.txt $R/ 2>/dev/null
for f in $C/*-$PH.txt; do echo "== $f"; grep -E "FALSE|false failures|Error|error" $f | tail -3; done
grep -hE "PASS|FAIL|ERROR|NOT" $R/vllm-chunk-*.txt $R/sglang-decode.txt $R/hf-chunk.txt $R/vllm-packed.txt 2>/dev/null | head -40
cd $OUT && tar czf p$PH.tgz p$PH && rm -rf p$PH
