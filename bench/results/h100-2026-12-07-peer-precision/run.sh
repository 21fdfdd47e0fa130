T0=$(date +%s)
mkdir -p /tmp/fi && test -d /tmp/fi/site || (cat /tmp/fi-parts/site.tar.xz.part0 .whl-fi/p2/site.tar.xz.part1 | xz -d | tar -x -C /tmp/fi) || echo "FI extract failed"
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=$OUT/p; mkdir -p $R
V="python -m kvbuffer.cli validate"
(nvidia-smi --query-gpu=name,driver_version --format=csv; python -c "import torch,triton,transformers,sys;print(sys.version.split()[0],torch.__version__,triton.__version__,'transformers',transformers.__version__)"; PYTHONPATH=/tmp/fi/site python -c "import flashinfer; print('flashinfer', flashinfer.__version__)"; git log -1 --format=%h) > $R/env.txt 2>&1
L=${L:-540}
(timeout $L $V --impl flashinfer --impl flashinfer-bf16 --impl flashinfer-mtp --profile gpu --device cuda --seed 11 --peer-path /tmp/fi/site --json $R/fi-gpu.json > $R/fi-gpu.txt 2>&1
 left=$(( L - ($(date +%s) - T0) - 5 ))
 timeout $left $V --impl sglang-inputs --ops engine_inputs --peer-path .sgl-tree --device cuda --profile gpu --seed 11 --json $R/sinputs-gpu.json > $R/sinputs-gpu.txt 2>&1
 left=$(( L - ($(date +%s) - T0) - 5 ))
 timeout $left $V --impl vllm-inputs --ops engine_inputs --peer-path .vllm-tree --device cuda --profile gpu --seed 11 --json $R/vinputs-gpu.json > $R/vinputs-gpu.txt 2>&1) &
timeout $L $V --report precision --impl flashinfer --impl flashinfer-bf16 --state-dtype float32,bfloat16 --models all --steps 256 --device cuda --peer-path /tmp/fi/site --json $R/fi-precision.json > $R/fi-precision.md 2>&1 &
timeout $L $V --report precision --impl replayssm --impl fast --state-dtype float32,bfloat16 --models all --steps 256 --device cuda --peer-path .rssm-tree --json $R/rssm-fast-precision.json > $R/rssm-fast-precision.md 2>&1 &
timeout $L $V --impl fast --ops prefill --dtype float32 --device cuda --profile gpu --seed 11 --json $R/fast-prefill-float32.json > $R/fast-prefill-float32.txt 2>&1 &
if nvidia-smi --query-gpu=name --format=csv | grep -q H200; then
  timeout $L $V --impl sglang --impl sglang-decode --impl sglang-packed --impl sglang-pool --peer-path .sgl-tree --profile gpu --device cuda --seed 11 --json $R/sgl-gpu.json > $R/sgl-gpu.txt 2>&1 &
  (timeout $L $V --impl vllm-decode --impl vllm-packed --peer-path .vllm-tree --profile gpu --device cuda --seed 11 --json $R/vllm2-gpu.json > $R/vllm2-gpu.txt 2>&1
   left=$(( L - ($(date +%s) - T0) - 5 ))
   timeout $left $V --impl hf --profile gpu --device cuda --seed 11 --json $R/hf-gpu.json > $R/hf-gpu.txt 2>&1) &
fi
wait
echo "done $(( $(date +%s) - T0 )) s" >> $R/env.txt
cat $R/env.txt; for f in $R/*.txt $R/*.md; do echo "== $f"; grep -v "^  \.\.\." $f | cut -c1-400 | head -30; done
