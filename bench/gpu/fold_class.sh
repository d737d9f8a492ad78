#!/usr/bin/env bash
# Class-depth folding on one GPU (device `nvidia-h200`, one call): issue 19's own example, a
# Llama-3-8B-shaped GPT at TP2·PP4 (8 ranks of 9-32 GB, which a full capture cannot hold on one H200),
# folded to one live rank per class (first stage, one middle stage, last stage: 3 processes), and a
# smaller job of the same layout that fits both ways, captured whole and folded at class depth.
# Run from the repo root with the wheels installed into /tmp/site by the caller:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   bash bench/gpu/fold_class.sh            # JOBS="small-full small-class llama8b-class"
# Writes $OUT/fold-class/{JOB.log, JOB.metrics, JOB.summary.txt} and $OUT/fold-class/traces.tar.gz; the
# traces are replayed afterwards on any machine (prism-megatron report TRACE).
set -uo pipefail
out=${OUT:-/tmp/prism-gpu}/fold-class
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_MODE=disabled
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
script=prism_megatron/megatron/driver/core_gpt.py
common="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --tokenizer-type NullTokenizer
  --vocab-size 32000 --mock-data --micro-batch-size 1 --global-batch-size 8 --train-iters ${ITERS:-3} --bf16
  --lr 0.0001 --seed 1234 --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
  --log-interval 1 --eval-iters 0 --eval-interval 1000"
# the issue's Llama-3-8B shape (32 layers, hidden 4096, FFN 14336, 32 heads, 8 query groups, seq 4096)
llama="--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
  --group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096"
# the same layout at a size whose 8 ranks fit one H200 together
small="--num-layers 8 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16
  --group-query-attention --num-query-groups 4 --seq-length 2048 --max-position-embeddings 2048"
for job in ${JOBS:-small-full small-class llama8b-class}; do
  case $job in
    small-full) shape=$small; fold="--prism-fold off" ;;
    small-class) shape=$small; fold="--prism-fold on --prism-fold-depth class" ;;
    llama8b-class) shape=$llama; fold="--prism-fold on --prism-fold-depth class" ;;
    *) echo "unknown job $job"; exit 2 ;;
  esac
  rm -f "$out/$job.metrics"
  t0=$(date +%s)
  PRISM_MEGATRON_METRICS="$out/$job.metrics" timeout ${RUN_TIMEOUT:-240} python3 -m prism_megatron run \
    --prism-emulate --prism-world-size 8 --prism-devices 0 --prism-driver core $fold --prism-swap none \
    --prism-track-memory on --prism-report off --prism-log-ranks none --prism-trace-dir /tmp/fold-class-$job \
    $script $common $shape > "$out/$job.log" 2>&1
  rc=$?
  echo "== $job: exit $rc in $(( $(date +%s) - t0 )) s"
  grep -E "^fold|live rank|iteration +[0-9]+/" "$out/$job.log" | cut -c1-220 | head -12
  [ $rc -ne 0 ] && tail -30 "$out/$job.log"
  if [ -f /tmp/fold-class-$job/manifest.json ]; then
    python3 -m prism_megatron trace show /tmp/fold-class-$job > "$out/$job.summary.txt" 2>&1
    python3 - "$job" <<'PY' | tee -a "$out/$job.summary.txt"
import json, sys
from prism_megatron.trace import read_trace
t = read_trace(f"/tmp/fold-class-{sys.argv[1]}")
peak = {}
for m in t.marks.to_pylist():
    if m["name"] == "memory":
        a = json.loads(m["attrs"])
        r = m["rank"]
        peak[r] = (max(peak.get(r, (0, 0))[0], a.get("max_allocated", 0)), max(peak.get(r, (0, 0))[1], a.get("max_reserved", 0)))
for r in sorted(peak):
    print(f"rank {r}: max allocated {peak[r][0]} B, max reserved {peak[r][1]} B")
PY
  fi
done
tar czf "$out/traces.tar.gz" -C /tmp $(cd /tmp && ls -d fold-class-* 2>/dev/null | grep -v '\.logs$') 2>/dev/null
ls -la "$out"
