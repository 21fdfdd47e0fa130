# 1. timing alone on the GPU: the fold inside verify against the separate fold and ReplaySSM
timeout 230 python -m bench.gpu --ops read_state,verify,round,round_cycle,round_cycle_fold,pool_round_cycle,replayssm_round,replayssm_round_cycle --batches 64,128,256,512 --peer-path ../.rssm-tree --sglang-path '' --flashinfer-path '' --out $R/bench --budget-s 220 > $R/bench.txt 2>&1
echo "bench done $(( $(date +%s) - T0 )) s" >> $R/env.txt
