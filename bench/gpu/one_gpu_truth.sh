#!/usr/bin/env bash
# One-GPU ground truth of per-rank compute (device `nvidia-h200`, one call): real single-GPU runs of the
# training driver against prism's prediction of the same job as 1, 2, ... data-parallel ranks on GPU 0,
# communication free (bench/gpu/one_gpu_truth.py says what runs). Run from the repo root with the wheels
# (megatron-core 0.19.x, and what the image lacks) installed into /tmp/site by the caller:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   bash bench/gpu/one_gpu_truth.sh [one_gpu_truth.py flags: --configs, --plan, --iters, --budget]
# Writes $OUT/one-gpu-truth.{json,txt} and $OUT/traces.tar.gz; BUDGET (seconds, default 420) stops new steps;
# $OUT/gpu-clocks.csv: the GPU's SM and memory clocks, power, temperature and throttle reasons every 0.5 s, to set
# beside the runs' timestamped iterations (a real run's iterations switch between two steady levels);
# $OUT/host-cpus.csv: each second, how busy and how stolen this machine's CPUs were (bench/gpu/host_sampler.py);
# $OUT/host-threads.jsonl: each second, every Python thread's time on a CPU, runnable and its switches (thread_sampler.py).
# $OUT/cpu-pairs-{before,after}.txt: how much CPU 1 slows while each other CPU computes (cpu_pairs.py, ~15 s each; a
# host whose vCPUs share physical cores shows ratios of 1.5-2, and its host-bound steps move 10-20 % between runs);
# CPU_PAIRS=0 skips them.
# PACK (a path outside $OUT): all of $OUT packed there at the end, one file (a device call brings back a limited
# number of files: PACK=$OUT/truth.tar.gz OUT=/tmp/w on the device machine, PACK first so that it names the call's OUT).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_MODE=disabled
out=${OUT:-/tmp/prism-gpu}
case "${PACK:-}" in
  "$out"/*) echo "PACK=$PACK is inside OUT=$out: it would pack itself (set PACK before OUT on the command line)" >&2
            exit 2 ;;
esac
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
echo "cores: $(nproc); hyperthread siblings: $(sort -u /sys/devices/system/cpu/cpu*/topology/thread_siblings_list 2>/dev/null | tr '\n' ' ')"
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'megatron-core', m.__version__)"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 500 > "$out/gpu-clocks.csv" 2>/dev/null & sampler=$!
python3 bench/gpu/host_sampler.py "$out/host-cpus.csv" & cpus=$!
python3 bench/gpu/thread_sampler.py "$out/host-threads.jsonl" & threads=$!
pairs() { [ "${CPU_PAIRS:-1}" = 0 ] || python3 bench/gpu/cpu_pairs.py --base 1 > "$out/cpu-pairs-$1.txt" 2>&1; }
pairs before
python3 bench/gpu/one_gpu_truth.py --out "$out" --budget "${BUDGET:-420}" "$@"
rc=$?
pairs after
kill "$sampler" "$cpus" "$threads" 2>/dev/null
if [ -n "${PACK:-}" ]; then
  tar czf "$PACK" -C "$out" . || rc=1
fi
exit "$rc"
