set -x
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/fla_core-0.6.0-py3-none-any.whl
export PYTHONPATH=$(pwd):/tmp/site PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/tc
R=$OUT/k1; mkdir -p $R
V="python -m kvbuffer.cli validate"
(nvidia-smi --query-gpu=name,driver_version --format=csv; python -c "import torch,triton,fla,transformers,sys;print(sys.version.split()[0],torch.__version__,triton.__version__,fla.__version__,transformers.__version__)"; git log -1 --format=%h 2>/dev/null) > $R/env.txt 2>&1
# 1. timing alone on the GPU: every peer but FlashInfer (its wheels arrive in the next call), B = 64..512
timeout 140 python -m bench.gpu --ops read_state,buffered_decode,replayssm_decode,sglang_decode,verify,round_cycle_fold,pool_round_cycle_fold,replayssm_round_cycle --batches 64,256,512 --peer-path .rssm-tree --sglang-path .sgl-tree --flashinfer-path '' --out $R/bench --budget-s 125 > $R/bench.txt 2>&1
echo "bench done $(( $(date +%s) - T0 )) s" >> $R/env.txt
L=$(( 370 - ($(date +%s) - T0) ))
# 2. correctness side by side: HF's chunk case, the lanes the matrix lacks, each peer's precision growth
timeout $L python bench/results/h100-2026-12-07-peers/hfdiag.py > $R/hfdiag-image.json 2> $R/hfdiag-image.err &
(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/tf525 .whl2/transformers-5.25.0-py3-none-any.whl && PYTHONPATH=/tmp/tf525:$PYTHONPATH timeout $L python bench/results/h100-2026-12-07-peers/hfdiag.py > $R/hfdiag-525.json 2> $R/hfdiag-525.err) &
for dt in float32 float16 bfloat16; do
  timeout $L $V --impl fla --ops recurrent_varlen --dtype $dt --device cuda --profile gpu --seed 11 --json $R/fla-varlen-$dt.json > $R/fla-varlen-$dt.txt 2>&1 &
done
timeout $L $V --impl fla --ops recurrent_decode --dtype float16 --device cuda --profile gpu --seed 11 --json $R/fla-decode-float16.json > $R/fla-decode-float16.txt 2>&1 &
for dt in float16 bfloat16; do
  timeout $L $V --impl sglang-chunk --ops chunk_varlen --dtype $dt --device cuda --profile gpu --seed 11 --no-shrink --peer-path .sgl-tree --json $R/sglchunk-varlen-$dt.json > $R/sglchunk-varlen-$dt.txt 2>&1 &
done
for op in recurrent verify_chain decode flush; do
  timeout $L $V --impl replayssm --ops $op --contract tf32 --device cuda --profile gpu --seed 11 --peer-path .rssm-tree --json $R/rssm-gpu-$op.json > $R/rssm-gpu-$op.txt 2>&1 &
done
(timeout $L $V --report precision --impl reference --impl fast --impl fla --impl hf --state-dtype float32,bfloat16 --models all --device cuda --json $R/prec-ours-fla-hf.json > $R/prec-ours-fla-hf.md 2>&1
 true) &
timeout $L $V --report precision --impl sglang-packed --impl sglang-decode --state-dtype float32,bfloat16 --models all --device cuda --peer-path .sgl-tree --json $R/prec-sglang.json > $R/prec-sglang.md 2>&1 &
timeout $L $V --report precision --impl vllm-packed --impl vllm-decode --state-dtype float32,bfloat16 --models all --device cuda --peer-path .vllm-tree --json $R/prec-vllm.json > $R/prec-vllm.md 2>&1 &
timeout $L $V --report precision --impl replayssm --device cuda --peer-path .rssm-tree --json $R/prec-rssm.json > $R/prec-rssm.md 2>&1 &
wait
echo "all done $(( $(date +%s) - T0 )) s" >> $R/env.txt
cat $R/hfdiag-image.json $R/hfdiag-525.json; grep -hE "^(recurrent|chunk|decode|verify|flush)|PASSED|FAILED" $R/*.txt | head -40
tail -30 $R/bench.txt
cd $OUT && tar czf k1.tgz k1 && rm -rf k1
