#!/usr/bin/env bash
# A focused device check: the production-shape stateful pool test, the pool memory test with tracebacks,
# and the validator's prefill and verify lanes (fast, ReplaySSM), few processes, 4 CPU threads each.
set -u
OUT=${1:?out dir}; PEER=${2:-}
export OMP_NUM_THREADS=4 MKL_NUM_THREADS=4 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$(pwd):/tmp/site KVBUFFER_PEER_PATH=$PEER
L=${LIMIT:-400}
timeout $L python3 -m pytest -p no:cacheprovider -v --tb=short tests/pool/test_pool_memory.py \
  "tests/pool/test_pool_stateful.py::test_fast_pool_qwen3_next_shapes" > "$OUT/tests.log" 2>&1 &
v() { local n=$1; shift; timeout $L python3 -m kvbuffer_ref.validate.cli validate --device cuda --profile gpu \
  --max-examples 2 "$@" --json "$OUT/validate-$n.json" > "$OUT/validate-$n.log" 2>&1; }
v fast-prefill --impl fast --ops chunk,chunk_varlen,direct,prefill &
v fast-verify --impl fast --ops verify_chain,verify_tree,decode,flush &
[ -n "$PEER" ] && v replayssm --impl replayssm &
wait
tail -n 30 "$OUT/tests.log"; for f in "$OUT"/validate-*.log; do echo "--- $f"; tail -n 20 "$f"; done
python3 -c 'import torch, triton; print({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__})'
