#!/bin/bash
# The GPU check, run from the repository root on a lent GPU machine (device tool: `bash benchmarks/device_check.sh`,
# about 8 min on an H100): the GPU tests, then the staging / save / emergency / verify bench at 2 and 8.5 GB
# (and a 2 GB host state of small tensors), then the emergency save of a 32 GB state alone.
# Files go to $OUT (the device tool's folder), or to ./device-out elsewhere. On 2026-11-26 one H100 machine's disk
# needed more than MAIN_S=420 for the 8.5 GB bench (its store-save rows were cut): with less than 10 min of
# device time, run it as two calls (LARGE_GB= , empty, skips the large state).
set -o pipefail
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L | tee $OUT/env.txt; nproc | tee -a $OUT/env.txt; df -h /tmp | tee -a $OUT/env.txt
timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/training/test_staging.py tests/storage/test_checkpoint.py tests/storage/test_block_digest.py tests/storage/test_checkpoint_integrity.py 2>&1 | tail -8 | tee $OUT/tests.txt
cd benchmarks
timeout ${MAIN_S:-420} python3 bench_gpu_staging.py --gb ${GB:-2,8} --session-gb 8 --mixed-gb ${MIXED_GB:-2} --repeats 3 --json $OUT/gpu.json 2>&1 | grep -v "bit-exact\|^preemption notice" | tee $OUT/bench.txt
echo "bench rc=$?"
LARGE_GB=${LARGE_GB-32}
if [ -n "$LARGE_GB" ]; then
  timeout ${LARGE_S:-150} python3 bench_gpu_staging.py --emergency-gb $LARGE_GB --json $OUT/gpu-large.json 2>&1 | grep -v "bit-exact\|^preemption notice" | tee $OUT/bench-large.txt
  echo "large rc=$?"
fi
