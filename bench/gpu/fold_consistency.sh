#!/usr/bin/env bash
# Folded vs full capture on one GPU (device `nvidia-h200`, one call of about 7 minutes): a dense
# TP2·PP2·DP2 and a MoE PP2·EP2·DP4 GPT of 8 ranks, each captured whole and folded (4 live);
# bench/gpu/fold_consistency.py says what runs and prints. Run from the repo root with the wheels
# (megatron-core 0.19.x, and what the image lacks) installed into /tmp/site by the caller:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   bash bench/gpu/fold_consistency.sh [fold_consistency.py flags: --jobs, --hidden, --mbs, --iters, ...]
# Writes $OUT/fold_consistency.{json,txt}, $OUT/traces.tar.gz, $OUT/run.log and $OUT/host.log; BUDGET (seconds,
# default 440) stops new runs.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-/tmp/prism-gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
echo "cores: $(nproc); hyperthread siblings: $(sort -u /sys/devices/system/cpu/cpu*/topology/thread_siblings_list 2>/dev/null | tr '\n' ' ')"
echo "NUMA nodes (CPUs): $(for n in /sys/devices/system/node/node[0-9]*; do [ -e "$n/cpulist" ] && printf '%s: %s  ' "${n##*/}" "$(cat "$n/cpulist")"; done); GPU's node: $(cat /sys/bus/pci/devices/*/numa_node 2>/dev/null | sort | uniq -c | tr '\n' ' ')"
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'megatron-core', m.__version__)"
# the host every 5 s (load, available memory, swap; each python process's CPU and %CPU): a run that stops
# making progress says whether the host did, and a rank's host time can be set beside where it ran
( while sleep 5; do echo "$(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) $(awk '/^(MemAvailable|SwapFree|Dirty):/ {printf "%s %d MiB ", $1, $2 / 1024}' /proc/meminfo)"
  echo "  pid/cpu/%cpu: $(ps -C python3,python -o pid=,psr=,pcpu= 2>/dev/null | awk '{printf "%s/%s/%s ", $1, $2, $3}')"; done ) > "$out/host.log" 2>&1 &
sampler=$!
python3 bench/gpu/fold_consistency.py --devices 0 --work /tmp/fold-consistency --out "$out" \
  --budget "${BUDGET:-440}" "$@" 2>&1 | tee "$out/run.log"
kill "$sampler" 2>/dev/null
