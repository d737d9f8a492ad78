#!/usr/bin/env bash
# Issue 18's GPU check (device `nvidia-h200`): a GPT job of 2 data-parallel logical ranks on GPU 0, run by
# our own driver (--prism-driver core), once per entry of MODES:
#   auto            --prism-swap auto on the whole GPU
#   checkpoint      --prism-swap checkpoint on the whole GPU
#   auto-low, checkpoint-low   the same with --prism-device-memory DEVICE_GIB: the device declared smaller
#                   than the two ranks' peaks together, so they cannot be resident at once and every turn
#                   that needs the other rank swaps (more swaps). DEVICE_GIB=auto (default): 1.5 x the
#                   largest rank's peak (max reserved + 0.8 GiB of context) in the latest run's trace
# Each run must end (3 iterations) with the same losses and grad norms as the others (swaps move state,
# they do not change it); the script prints them, the swaps (count, GiB moved, seconds), how each turn's
# room was known (own peak / class peak / bound), the host-memory need, the GPU-timing verdict, and the
# capture wall against the physical limit (trace show). A run that ran out of device memory prints its
# report instead (device-oom-report.txt).
# Defaults are the issue's job: 24 layers, hidden 1536, micro-batch 8, global batch 32, bf16, seq 2048
# (one rank holds ~96 GiB after iteration 1, prism's estimate 98.4 GiB, so two never fit together; at seq
# 4096 one rank alone would need ~313 GiB). Each swap moves up to ~96 GiB: ~45 s at the checkpoint API's
# ~2.3 GB/s, seconds in-process (docs/measurements.md, "In-process swaps"). Smaller shapes through LAYERS,
# HIDDEN, HEADS, SEQ, MBS, GBS, ITERS; HOST_GIB sets --prism-host-memory. Run from the repo root with .whl carried:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   bash bench/gpu/admission.sh      # MODES="auto checkpoint auto-low checkpoint-low" DEVICE_GIB=auto
#   LAYERS=8 HIDDEN=1024 HEADS=8 SEQ=512 MODES="auto checkpoint-low" bash bench/gpu/admission.sh
set -uo pipefail
out=${OUT:-/tmp/prism-gpu}/admission
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_MODE=disabled
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
script=prism_megatron/megatron/driver/core_gpt.py
seq=${SEQ:-2048}
flags="--num-layers ${LAYERS:-24} --hidden-size ${HIDDEN:-1536} --num-attention-heads ${HEADS:-12}
  --seq-length $seq --max-position-embeddings $seq --tokenizer-type NullTokenizer --vocab-size 32000 --mock-data
  --micro-batch-size ${MBS:-8} --global-batch-size ${GBS:-32} --train-iters ${ITERS:-3} --bf16 --lr 0.0001
  --seed 1234 --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
  --log-interval 1 --eval-iters 0
  --eval-interval 1000"
echo "flags: $(echo $flags)"
device_gib=${DEVICE_GIB:-auto}
last=""
for entry in ${MODES:-auto checkpoint auto-low checkpoint-low}; do
  mode=${entry%-low}
  if [ "$entry" != "$mode" ] && [ "$device_gib" = auto ]; then
    device_gib=$(python3 - "$last" <<'PY'
import math, sys, json
from prism_megatron.trace import read_trace
marks = read_trace(f"/tmp/admission-{sys.argv[1]}").marks.to_pylist()
peak = max(json.loads(m["attrs"]).get("max_reserved", 0) for m in marks if m["name"] == "memory")
print(math.ceil(1.5 * (peak / 2**30 + 0.8)))
PY
) || { echo "DEVICE_GIB=auto needs an earlier run of MODES with a trace"; exit 1; }
    echo "device declared: $device_gib GiB (1.5 x the largest rank's peak in run $last)"
  fi
  extra=""; [ "$entry" != "$mode" ] && extra="--prism-device-memory $device_gib"
  [ -n "${HOST_GIB:-}" ] && extra="$extra --prism-host-memory $HOST_GIB"
  rm -f "$out/$entry.metrics"
  t0=$(date +%s)
  PRISM_MEGATRON_METRICS="$out/$entry.metrics" timeout ${RUN_TIMEOUT:-3000} python3 -m prism_megatron run \
    --prism-emulate --prism-world-size 2 --prism-devices 0 --prism-driver core --prism-swap $mode $extra --prism-fold off \
    --prism-report off --prism-trace-dir /tmp/admission-$entry $script $flags > "$out/$entry.log" 2>&1
  echo "== --prism-swap $mode $extra: exit $? in $(( $(date +%s) - t0 )) s"
  grep -E "iteration +[0-9]+/" "$out/$entry.log" | sed -E 's/.*(iteration +[0-9]+).*(lm loss: [^|]*).*(grad norm: [^|]*).*/\1 \2 \3/'
  grep -E "prism: (swapped-out|.*GPU timing|.*report written|the trace so far)" "$out/$entry.log" | head -5
  cat /tmp/admission-$entry.logs/device-oom-report.txt 2>/dev/null
  cp /tmp/admission-$entry.logs/coordinator.log "$out/$entry.coordinator.log" 2>/dev/null
  # the trace itself (ops, segments' GPU times), for the predictions under swaps; the rank logs beside it
  tar czf "$out/$entry.trace.tar.gz" -C /tmp admission-$entry admission-$entry.logs/rank-0.log \
    admission-$entry.logs/rank-1.log 2>/dev/null
  [ -f /tmp/admission-$entry/manifest.json ] && last=$entry
  python3 - "$entry" <<'PY'
import sys
from pathlib import Path
from prism_megatron.trace import read_trace
from prism_megatron.trace.summary import summarize
path = Path(f"/tmp/admission-{sys.argv[1]}")
if not (path / "manifest.json").exists():
    sys.exit("no trace: the run did not end (see the log)")
job = read_trace(path).manifest["job"]
swap = job.get("swap", {})
print("swaps out/in:", sum(s["swaps_out"] for s in swap.values()), "/", sum(s["swaps_in"] for s in swap.values()),
      "| GiB out/in:", round(sum(s["bytes_out"] for s in swap.values()) / 2**30, 1), "/",
      round(sum(s["bytes_in"] for s in swap.values()) / 2**30, 1),
      "| swap s:", round(sum(s["seconds"] for s in swap.values()), 1))
print("admission:", job.get("admission"), "| end:", job.get("end", "complete"))
print("host memory:", job.get("host_memory_need"))
print("GPU timing:", job.get("gpu_timing_by_device"), "| footprint check:", job.get("footprint_check"))
print(summarize(path))
PY
done
