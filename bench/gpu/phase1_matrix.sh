#!/usr/bin/env bash
# Issue 2's GPU check (device `nvidia-h200`): the op matrix with CUDA tensors, 8 logical ranks sharing one
# GPU with 2 slots, against the same program under gloo with 8 real CPU processes; plus 64 ranks of a
# small training-like loop on one GPU. Run from the repo root with .whl carried (click, pyarrow):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD bash bench/gpu/phase1_matrix.sh "$OUT"
set -uo pipefail
out=${1:-/tmp/prism-gpu}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
work=$(mktemp -d)
t0=$(date +%s.%N)
python3 -m prism_megatron launch -w 8 --devices 0 --slots-per-device 2 --log-ranks none --hang-timeout 60 \
  --trace-dir "$work/trace" tests/programs/op_matrix.py "$work/prism" cuda; rc=$?
echo "prism cuda op matrix: exit $rc, $(python3 -c "import time;print(round(time.time()-$t0,1))") s"
tail -n 30 "$work/trace.logs/rank-0.log" > "$out/rank0_tail.log" 2>/dev/null
python3 -m torch.distributed.run --nproc-per-node=8 --master-port=29655 tests/programs/op_matrix.py \
  "$work/gloo" > "$work/gloo.log" 2>&1; echo "gloo cpu op matrix: exit $?"; grep -v "^\[rank" "$work/gloo.log" | tail -n 40 > "$out/gloo_tail.log"; grep -m5 -E "Error|error" "$work/gloo.log"
python3 bench/gpu/compare_matrix.py "$work/prism" "$work/gloo" 8 | tee "$out/compare.txt"
python3 -m prism_megatron trace show "$work/trace" > "$out/trace_summary.txt" 2>&1 || true
t0=$(date +%s.%N)
python3 -m prism_megatron launch -w 64 --devices 0 --slots-per-device 2 --log-ranks none \
  --trace-dir "$work/ring" tests/programs/ring.py 3; echo "ring 64 ranks on 1 GPU: exit $?, $(python3 -c "import time;print(round(time.time()-$t0,1))") s"
