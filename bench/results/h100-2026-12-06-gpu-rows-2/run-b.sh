set -x
mkdir -p /tmp/fi && ls /tmp/fi-p1 && cat /tmp/fi-p1/site.tar.xz.part0 .fi-p2/site.tar.xz.part1 | xz -d | tar -x -C /tmp/fi || echo "FI SITE FAILED"
cd .snap
export PYTHONPATH=$(pwd):/tmp/site PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 TRITON_CACHE_DIR=/tmp/tc
R=$OUT/b; mkdir -p $R
VAL="import sys;from kvbuffer.cli import main;sys.exit(main())"
(nvidia-smi --query-gpu=name,driver_version --format=csv; python -c "import torch,triton;print(torch.__version__,triton.__version__)"; ls /tmp/fi/site | head -30; python -m pip show transformers 2>/dev/null | head -2) > $R/env.txt 2>&1
timeout 150 python -m pytest tests/validate/test_flashinfer_peers.py tests/bench/test_flashinfer_peer.py -q -p no:cacheprovider > $R/fi-tests.txt 2>&1 &
timeout 560 python -c "$VAL" validate --impl flashinfer --impl flashinfer-bf16 --impl flashinfer-mtp --peer-path /tmp/fi/site --device cuda --profile ci --seed 11 --json $R/fi-ci.json > $R/fi-ci.txt 2>&1 &
timeout 560 python -c "$VAL" validate --impl flashinfer --impl flashinfer-bf16 --impl flashinfer-mtp --peer-path /tmp/fi/site --device cuda --profile gpu --seed 11 --json $R/fi-gpu.json > $R/fi-gpu.txt 2>&1 &
timeout 560 python -c "$VAL" validate --impl sglang-inputs --ops engine_inputs --peer-path ../.sgl-tree --device cuda --profile gpu --seed 11 --json $R/sinputs-gpu.json > $R/sinputs-gpu.txt 2>&1 &
timeout 560 python -c "$VAL" validate --impl vllm-inputs --ops engine_inputs --peer-path ../.vllm-tree --device cuda --profile gpu --seed 11 --json $R/vinputs-gpu.json > $R/vinputs-gpu.txt 2>&1 &
timeout 560 python -c "$VAL" validate --impl vllm-decode --impl vllm-packed --peer-path ../.vllm-tree --profile gpu --device cuda --seed 11 --json $R/vllm2-gpu.json > $R/vllm2-gpu.txt 2>&1 &
timeout 560 python -c "$VAL" validate --impl hf --profile gpu --device cuda --seed 11 --json $R/hf-gpu.json > $R/hf-gpu.txt 2>&1 &
timeout 560 python -c "$VAL" validate --impl sglang --impl sglang-decode --impl sglang-packed --impl sglang-pool --peer-path ../.sgl-tree --profile gpu --device cuda --seed 11 --json $R/sgl-gpu.json > $R/sgl-gpu.txt 2>&1 &
wait
cd $OUT && tar czf b.tgz b && rm -rf b
ls -la $OUT
