#!/usr/bin/env bash
# Prediction accuracy on GPUs (device `nvidia-h200-x2`): real 2-GPU NCCL runs of a ~1B-parameter GPT
# (TP2, PP2, DP2, EP2) against the same jobs emulated on GPU 0 and replayed with the cluster profile
# h200-nvlink-ib400; prints the table, writes $OUT/accuracy/accuracy.{json,txt}. Target: mean absolute
# error <= 1 %. Run from the repo root, with the wheels (megatron-core, click, pyarrow, ...) installed
# into /tmp/site by the caller:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   bash bench/gpu/accuracy.sh
# Keeps to ~8 minutes: no config starts after --budget seconds (one config takes ~1-2 minutes; with
# REAL_REPEATS=2 ~150-175 s, so BUDGET=420 fits three of the four: run EP2 in its own call).
# ONLY=gpu-tp2,gpu-pp2 runs a subset (names carry -mbsN when MBS is set: gpu-tp2-mbs8); ITERS (default 6),
# BUDGET (default 330 s) and REAL_REPEATS (2: a real run before and after the emulation) likewise; MBS=8 makes
# the jobs device-bound (micro-batch 1 is host-bound on an H200).
set -uo pipefail
out=${OUT:-/tmp/prism-gpu}/accuracy
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m > "$out/topo.txt" 2>&1 || true  # NVLink or PCIe between the two GPUs: what the profile assumes
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'megatron-core', m.__version__)"
python3 bench/accuracy/run.py --gpu --iters "${ITERS:-6}" --budget "${BUDGET:-330}" --out "$out" \
  --work /tmp/prism-accuracy ${ONLY:+--only "$ONLY"} ${MBS:+--gpu-mbs "$MBS"} ${REAL_REPEATS:+--gpu-real-repeats "$REAL_REPEATS"}
rc=$?
# the emulated ranks' logs (GPU timing summary, errors) next to the table
mkdir -p "$out/logs"
find /tmp/prism-accuracy \( -name 'emulated-*.log' -o -path '*trace-*.logs/rank-*.log' \) -print |
  while read -r f; do cp "$f" "$out/logs/$(echo "${f#/tmp/prism-accuracy/}" | tr / _)"; done
# the emulated traces, small enough to bring back: replay them again with other models
find /tmp/prism-accuracy -maxdepth 3 -type d -name 'trace-1slot' -print | while read -r d; do
  name=$(basename "$(dirname "$d")"); tar -C "$d" -czf "$out/trace-$name.tar.gz" .; done
exit $rc
