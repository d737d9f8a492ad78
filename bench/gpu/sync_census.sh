#!/usr/bin/env bash
# Waits for the GPU per iteration in the real DP2 and TP2 jobs of bench/accuracy (device nvidia-h200-x2).
# Wheels in /tmp/site (see accuracy.sh). Writes $OUT/census/<case>/census-rank*.txt.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
for case in ${CASES:-gpu-dp2}; do
  dir=${OUT:-/tmp/prism-gpu}/census/$case; mkdir -p "$dir"
  flags=$(python3 -c "import sys; sys.path.insert(0, 'bench/accuracy'); import run; \
print(' '.join(next(c for c in run.gpu_cases(3, 'bf16') if c.name == '$case').flags))")
  SYNC_CENSUS=$dir timeout 200 python3 -m torch.distributed.run --nproc-per-node=2 --master-port=29533 \
    bench/gpu/sync_census.py $flags > "$dir/run.log" 2>&1 || tail -20 "$dir/run.log"
  cat "$dir"/census-rank*.txt
done
