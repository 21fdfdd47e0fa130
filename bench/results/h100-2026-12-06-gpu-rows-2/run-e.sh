# 2. correctness, side by side
python scripts/fla_fixed_configs.py /tmp/flacfg > $R/flacfg.txt 2>&1
for i in 0 1 2 3; do
  FLA_CACHE_MODE=default FLA_CONFIG_DIR=/tmp/flacfg timeout $L python scripts/false_failures.py --device cuda --profile ci --impl fla --ops chunk,chunk_varlen --head-shapes "2,4,16,16;1,1,8,24" --seeds 50 --first-seed $((i*50)) --time-limit $((L-40)) --json $R/fla-$i.json > $R/fla-$i.txt 2>&1 &
done
KVBUFFER_PEER_PATH=../.rssm-tree timeout $L python -m pytest tests/property/test_fast_verify.py tests/pool tests/validate/test_peers.py tests/bench/test_bench_peers.py -q -p no:cacheprovider -n 3 --dist loadgroup > $R/tests.txt 2>&1 &
timeout $L python -c "$VAL" validate --impl replayssm --peer-path ../.rssm-tree --device cuda --profile gpu --seed 11 --json $R/rssm-gpu.json > $R/rssm-gpu.txt 2>&1 &
timeout $L python -c "$VAL" validate --impl replayssm --peer-path ../.rssm-tree --device cuda --profile ci --seed 11 --json $R/rssm-ci.json > $R/rssm-ci.txt 2>&1 &
wait
