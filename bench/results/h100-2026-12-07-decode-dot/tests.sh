T0=$(date +%s)
mkdir -p /tmp/fi-parts && cp .whl-fi/p1/site.tar.xz.part0 /tmp/fi-parts/
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 TRITON_CACHE_DIR=/tmp/tc
R=$OUT/t; mkdir -p $R
timeout 200 python -m pytest tests/kernels/test_fast_lowp_state.py tests/property/test_fast_decode.py -q -p no:cacheprovider -n 8 -x > $R/tests.txt 2>&1
echo "rc $? $(( $(date +%s) - T0 )) s" >> $R/tests.txt
tail -15 $R/tests.txt
