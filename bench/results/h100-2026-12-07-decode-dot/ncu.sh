export PYTHONPATH=$(pwd) TRITON_CACHE_DIR=/tmp/tc
R=$OUT/p; mkdir -p $R
which ncu > $R/ncu.txt 2>&1 || ls /usr/local/cuda*/bin/ncu >> $R/ncu.txt 2>&1
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu | head -1)
python .dbg/prof_decode.py 64 > /dev/null 2>&1
timeout 240 $NCU --clock-control none --profile-from-start off -k regex:_decode_kernel --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats python .dbg/prof_decode.py 64 > $R/ncu-decode.txt 2>&1
echo "rc $?" >> $R/ncu.txt
grep -E "Profiling|Duration|DRAM Throughput|L1/TEX Cache Throughput|L2 Cache Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Stall|Warp Cycles Per Issued|Issued Warp" $R/ncu-decode.txt | head -120
cat $R/ncu.txt
