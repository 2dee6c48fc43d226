#!/bin/bash
# The large-state emergency save on a lent GPU machine (device tool: `bash benchmarks/device_check_large.sh`,
# about 3 min on an H100): 16 and 32 GB of state, block and whole-file digest, one checkpoint on the disk at a time.
# Files go to $OUT (the device tool's folder), or to ./device-out elsewhere.
set -o pipefail
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L | tee $OUT/env-large.txt; df -h /tmp | tee -a $OUT/env-large.txt; free -g | tee -a $OUT/env-large.txt
cd benchmarks && timeout 400 python3 bench_gpu_staging.py --emergency-gb 16,32 --json $OUT/gpu-large.json 2>&1 | tee $OUT/bench-large.txt
echo "bench rc=$?"
