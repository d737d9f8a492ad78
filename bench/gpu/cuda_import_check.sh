#!/usr/bin/env bash
# Whether importing prism's preload (torch, megatron-core, Megatron-LM's trainer, prism's patches) starts CUDA
# on this machine, and where: the launcher's own check (launch.start_cuda_import_check), then the import timed
# in a fresh interpreter, and per imported module (-X importtime, the 15 slowest). Where the check says CUDA
# starts, each rank imports Megatron after the fork (seconds per capture); this says which line does it.
# Run from the repo root on the GPU machine, megatron-core installed into /tmp/site by the caller:
#   bash bench/gpu/cuda_import_check.sh        (writes OUT/cuda-import-check.txt)
set -uo pipefail
name=cuda-import-check
. "$(dirname "$0")/../targets/setup.sh"
export PRISM_MEGATRON_DRIVER=training
{
  echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  python3 - <<'PY'
import time
from prism_megatron.launcher.launch import start_cuda_import_check
t = time.monotonic()
check = start_cuda_import_check(["prism_megatron.megatron.preload"])
print(f"check: starts CUDA = {check.result()} ({check.why or 'no'}) in {time.monotonic() - t:.1f} s")
PY
  for i in 1 2; do
    /usr/bin/time -f "import preload (take $i): %e s wall, %M KiB max RSS" \
      python3 -c "import prism_megatron.megatron.preload"
  done
  python3 -X importtime -c "import prism_megatron.megatron.preload" 2>&1 \
    | awk -F'|' '/import time:/ && $2+0 > 0 {print $2+0, $3}' | sort -rn | head -15 \
    | awk '{printf "importtime cumulative %.2f s %s\n", $1/1e6, $2}'
} 2>&1 | tee "$out/../cuda-import-check.txt"
rm -rf "$work"
