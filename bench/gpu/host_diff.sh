#!/usr/bin/env bash
# Real vs emulated host CPU per op for the TP2 job of bench/accuracy (device nvidia-h200-x2, ~4 min),
# emulated twice: ranks as fresh interpreters (the GPU's default) and forked from the launcher's template.
# Wheels in /tmp/site (see accuracy.sh). Writes $OUT/host-diff/{real,emulated}/rank-*.json and diff.txt.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
out=${OUT:-/tmp/prism-gpu}/host-diff; mkdir -p "$out"
case=${CASE:-gpu-tp2}
flags=$(python3 -c "import sys; sys.path.insert(0, 'bench/accuracy'); import run; \
print(' '.join(next(c for c in run.gpu_cases(4, 'bf16') if c.name == '$case').flags))")
HOST_PROFILE_DIR=$out/real timeout 240 python3 -m torch.distributed.run --nproc-per-node=2 --master-port=29534 \
  bench/gpu/host_profile.py $flags > "$out/real.log" 2>&1 || tail -20 "$out/real.log"
HOST_PROFILE_DIR=$out/emulated timeout 240 python3 -m prism_megatron run --prism-emulate --prism-world-size 2 \
  --prism-devices 0 --prism-slots-per-device 1 --prism-report off --prism-gpu-timing off \
  --prism-trace-dir /tmp/host-diff-trace bench/gpu/host_profile.py $flags > "$out/emulated.log" 2>&1 \
  || tail -20 "$out/emulated.log"
# the same with each rank forked from the launcher's template instead of a fresh interpreter
HOST_PROFILE_DIR=$out/emulated-fork timeout 240 python3 -m prism_megatron run --prism-emulate --prism-rank-start fork \
  --prism-world-size 2 --prism-devices 0 --prism-slots-per-device 1 --prism-report off --prism-gpu-timing off \
  --prism-trace-dir /tmp/host-diff-trace-fork bench/gpu/host_profile.py $flags > "$out/emulated-fork.log" 2>&1 \
  || tail -20 "$out/emulated-fork.log"
for r in 0 1; do python3 bench/gpu/host_diff.py "$out/real" "$out/emulated" $r; done | tee "$out/diff.txt"
for r in 0 1; do python3 bench/gpu/host_diff.py "$out/real" "$out/emulated-fork" $r | head -12; done | tee "$out/diff-fork.txt"
