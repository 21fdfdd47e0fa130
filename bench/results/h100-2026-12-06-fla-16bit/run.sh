set -x
T0=$(date +%s)
cd .snap
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site ../.whl/fla_core-0.6.0-py3-none-any.whl
export PYTHONPATH=$(pwd):/tmp/site PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TRITON_CACHE_DIR=/tmp/tc
R=$OUT/j; mkdir -p $R
(nvidia-smi --query-gpu=name,driver_version --format=csv; python -c "import torch,triton,fla,sys;print(sys.version.split()[0],torch.__version__,triton.__version__,fla.__version__)") > $R/env.txt 2>&1
python ../.dbg/ftz.py > $R/ftz.json 2>&1; cat $R/ftz.json
L=$(( ${TOT:-330} - ($(date +%s) - T0) ))
python scripts/fla_fixed_configs.py /tmp/flacfg > /dev/null 2>&1
export FLA_CACHE_MODE=default FLA_CONFIG_DIR=/tmp/flacfg
for w in chunk-float16 chunk_varlen-float16 chunk_varlen-bfloat16; do
  timeout $L python ../.dbg/fla_dump.py $w $R/dump-$w.pt > $R/dump-$w.txt 2>&1 &
done
timeout $L python scripts/false_failures.py --device cuda --profile ci --impl fast --ops chunk,chunk_varlen,direct,prefill --dtype float16 --seeds 200 --time-limit $((L-50)) --json $R/fast-f16.json > $R/fast-f16.txt 2>&1 &
timeout $L python scripts/false_failures.py --device cuda --profile ci --impl fast --ops chunk_varlen,chunk,prefill,direct --dtype float16 --seeds 200 --first-seed 1000 --time-limit $((L-50)) --json $R/fast-f16b.json > $R/fast-f16b.txt 2>&1 &
timeout $L python -m pytest tests/pool/test_pool_gpu.py -q -p no:cacheprovider > $R/pool-gpu.txt 2>&1 &
(timeout $L bash ../.dbg/vllm_chunk.sh > $R/vllm-chunk.txt 2>&1; mv vllm-chunk-ci-seed11.json $R/ 2>/dev/null) &
wait
echo "all done $(( $(date +%s) - T0 )) s" >> $R/env.txt
tail -3 $R/pool-gpu.txt; grep -E "passed|failed|PASS|FAIL|rc=" $R/vllm-chunk.txt | tail -12
for f in $R/dump-*.txt $R/fast-f16*.txt; do echo "== $f"; tail -4 $f; done
cd $OUT && tar czf j.tgz j && rm -rf j && ls -la $OUT
