set -x
T0=$(date +%s)
cd .snap
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site ../.whl/fla_core-0.6.0-py3-none-any.whl
export PYTHONPATH=$(pwd):/tmp/site PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TRITON_CACHE_DIR=/tmp/tc
R=$OUT/h; mkdir -p $R
VAL="import sys;from kvbuffer.cli import main;sys.exit(main())"
(nvidia-smi --query-gpu=name,driver_version --format=csv; python -c "import torch,triton,fla,sys;print(sys.version.split()[0],torch.__version__,triton.__version__,fla.__version__)"; nproc) > $R/env.txt 2>&1
python ../.dbg/tf32mode.py > $R/tf32mode.json 2>&1; cat $R/tf32mode.json
python scripts/fla_fixed_configs.py /tmp/flacfg > $R/flacfg.txt 2>&1
L=$(( 540 - ($(date +%s) - T0) ))
HS="2,4,16,16;1,1,8,24"
for op in chunk chunk_varlen; do for dt in float32 float16 bfloat16; do
  FS=0; [ $op = chunk_varlen ] && FS=100
  FLA_CACHE_MODE=default FLA_CONFIG_DIR=/tmp/flacfg timeout $L python scripts/false_failures.py --device cuda --profile ci --impl fla --ops $op --dtype $dt --head-shapes "$HS" --seeds 100 --first-seed $FS --time-limit $((L-70)) --json $R/fla-$op-$dt.json > $R/fla-$op-$dt.txt 2>&1 &
done; done
FLA_CACHE_MODE=default FLA_CONFIG_DIR=/tmp/flacfg timeout $L python ../.dbg/fla_anchor.py > $R/fla-anchor.txt 2>&1 &
KVBUFFER_PEER_PATH=../.rssm-tree timeout $L python -m pytest tests/property/test_fast_verify.py tests/pool tests/validate/test_peers.py tests/bench/test_bench_peers.py -q -p no:cacheprovider -n 3 --dist loadgroup > $R/tests.txt 2>&1 &
timeout $L python -c "$VAL" validate --impl replayssm --peer-path ../.rssm-tree --device cuda --profile ci --seed 11 --json $R/rssm-ci.json > $R/rssm-ci.txt 2>&1 &
wait
echo "all done $(( $(date +%s) - T0 )) s" >> $R/env.txt
tail -3 $R/tests.txt; tail -4 $R/fla-anchor.txt; grep -E "PASS|FAIL|ERROR" $R/rssm-ci.txt | head -30
for f in $R/fla-*.txt; do echo "== $f"; grep -E "FALSE|done|time limit|false failures" $f | tail -6; done
cd $OUT && tar czf h.tgz h && rm -rf h
tar czf - -C /tmp tc | split -b 15m - tc.tgz. ; ls -la $OUT; du -sh /tmp/tc
