#!/usr/bin/env bash
# Correctness on the device in one call: the compiled tests and the validator's lanes side by side
# (two gpu_check.sh instances; the Triton cache is shared and packed into OUT/triton-cache.tgz).
set -u
OUT=${1:?out dir}; shift
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$OUT/t" "$OUT/v" "$TRITON_CACHE_DIR"
[ -f .whl/triton-cache.tgz ] && tar -xzf .whl/triton-cache.tgz -C "$TRITON_CACHE_DIR"
TESTS_LIMIT=${TESTS_LIMIT:-420} bash scripts/gpu_check.sh "$OUT/t" tests > "$OUT/t/out.txt" 2>&1 &
VALIDATE_LIMIT=${VALIDATE_LIMIT:-420} bash scripts/gpu_check.sh "$OUT/v" validate "$@" > "$OUT/v/out.txt" 2>&1
wait
tail -n 40 "$OUT/t/out.txt"; tail -n 80 "$OUT/v/out.txt"
grep -E "FAILED|ERROR" "$OUT/t/tests.log" | head -40
tar -czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" . && ls -la "$OUT/triton-cache.tgz"
