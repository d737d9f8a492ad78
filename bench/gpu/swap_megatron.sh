#!/usr/bin/env bash
# Issue 4's Megatron check (device `nvidia-h200`, ~4 min): a GPT job of 8 logical ranks (DP8, ~134M
# parameters, fp32 Adam) on GPU 0, twice: with every rank resident (--prism-swap none) and with the
# device declared smaller than the 8 ranks' footprints together (--prism-device-memory, default 40 GiB),
# so the coordinator must checkpoint blocked ranks to host memory and restore them (--prism-swap
# checkpoint). Prints both runs' losses and grad norms (they must be equal: swaps move state, they do not
# change it) and the swap counts from the trace. Run from the repo root with .whl carried:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   bash bench/gpu/swap_megatron.sh            # DEVICE_GIB=40 ITERS=1 RUN_TIMEOUT=300 (seconds per run)
# MODES (default "none checkpoint") may also name auto (the default policy: all resident, so the device
# should be pinned and its ranks timed from iteration 3) and auto-small (auto with DEVICE_GIB declared:
# swaps in iteration 1, so GPU timing must stay off); each prints the verdict and the trace's GPU rows.
#   MODES=auto ITERS=3 bash bench/gpu/swap_megatron.sh; MODES=auto-small bash bench/gpu/swap_megatron.sh
# PRISM_SWAP_POLICY=fifo runs the slots without the scheduling heuristics (default resident-first).
# Measured (2026-12-01, one H200; bench/gpu/results/2026-12-01-swap-*): all resident 72-86 s for 3
# iterations (~5.8 GiB per rank); 40 GiB declared, 1 iteration: 162 s, 18 swaps each way (FIFO: 19),
# loss and grad norm equal. Each swapped iteration costs ~80 s (every all-rank collective needs the
# rank that does not fit); 20 GiB declared did not finish 2 iterations in 270 s.
set -uo pipefail
out=${OUT:-/tmp/prism-gpu}/swap-megatron
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_MODE=disabled
script=prism_megatron/megatron/driver/pretrain_gpt_mini.py
flags="--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024
  --tokenizer-type NullTokenizer --vocab-size 32000 --mock-data --micro-batch-size 2 --global-batch-size 16
  --train-iters ${ITERS:-1} --lr 0.0001 --seed 1234 --transformer-impl local --no-gradient-accumulation-fusion
  --log-interval 1 --eval-iters 0 --eval-interval 1000"
show() {
  grep -E "iteration +[0-9]+/" "$1" | sed -E 's/.*(iteration +[0-9]+).*(lm loss: [^|]*).*(grad norm: [^|]*).*/\1 \2 \3/'
  grep -m3 -E "Error|error:|prism: swap" "$1"
}
for entry in ${MODES:-none checkpoint}; do
  mode=${entry%-small}
  extra=""; [ "$entry" = checkpoint ] || [ "$entry" = auto-small ] && extra="--prism-device-memory ${DEVICE_GIB:-40}"
  t0=$(date +%s)
  timeout ${RUN_TIMEOUT:-300} python3 -m prism_megatron run --prism-emulate --prism-world-size 8 --prism-devices 0 \
    --prism-slots-per-device 2 --prism-swap $mode $extra --prism-trace-dir /tmp/swap-megatron-$entry \
    $script $flags > "$out/$entry.log" 2>&1
  echo "--prism-swap $mode $extra: exit $? in $(( $(date +%s) - t0 )) s"; show "$out/$entry.log"
  python3 - "$entry" <<'PY'
import sys
from pathlib import Path
from prism_megatron.trace import read_trace
path = Path(f"/tmp/swap-megatron-{sys.argv[1]}")
if not (path / "manifest.json").exists():
    sys.exit("no trace: the run did not end (see the log's progress lines)")
trace = read_trace(path)
job = trace.manifest["job"]
swap = job.get("swap", {})
print("GPU timing verdicts:", job.get("gpu_timing_by_device"), "| gpu rows:", trace.gpu.num_rows)
print("staging:", job.get("staging_by_device"), "| footprint check:", job.get("footprint_check"))
print("swaps out/in:", sum(s["swaps_out"] for s in swap.values()), "/", sum(s["swaps_in"] for s in swap.values()),
      "GiB out:", round(sum(s["bytes_out"] for s in swap.values()) / 2**30, 1),
      "swap s:", round(sum(s["seconds"] for s in swap.values()), 1))
PY
done
