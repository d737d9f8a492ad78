#!/usr/bin/env bash
# Issue 5's GPU check (device `nvidia-h200-x2`): each rank's peak memory predicted by emulating the
# job's 2 ranks on ONE GPU vs measured in the real 2-GPU run (torchrun + NCCL), for TP2, PP2 and an
# EP2 MoE; plus the OOM verdict bracketing a rank's real peak. GPT (local spec, bf16) 8 layers,
# hidden 1024, seq 1024, micro-batch 4, 4 microbatches, megatron-core 0.19.2, core driver.
# Run from the repo root with .whl carried:
#   bash bench/gpu/memory_matrix.sh "$OUT"      (then: python3 bench/gpu/memory_compare.py "$OUT")
set -uo pipefail
out=${1:-/tmp/prism-mem}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
driver=prism_megatron/megatron/driver/core_gpt.py
common="--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024
 --tokenizer-type NullTokenizer --vocab-size 32000 --mock-data --micro-batch-size 4 --global-batch-size 16
 --train-iters ${ITERS:-4} --lr 1e-4 --seed 1234 --optimizer adam --transformer-impl local
 --no-gradient-accumulation-fusion --log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0
 --bf16 --no-masked-softmax-fusion"
declare -A layouts=(
  [tp2]="--tensor-model-parallel-size 2"
  [pp2]="--pipeline-model-parallel-size 2"
  [ep2]="--expert-model-parallel-size 2 --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall
         --moe-ffn-hidden-size 2048 --moe-aux-loss-coeff 0.0"
)
port=29711
for name in ${LAYOUTS:-tp2 pp2 ep2}; do
  flags="$common ${layouts[$name]}"
  t0=$(date +%s)
  PRISM_MEGATRON_METRICS="$out/real-$name.jsonl" timeout 300 python3 -m torch.distributed.run --nproc-per-node 2 \
    --master-port $((port++)) $driver $flags > "$out/real-$name.log" 2>&1
  echo "$name real (2 GPUs, NCCL): exit $? in $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  PRISM_MEGATRON_METRICS="$out/emu-$name.jsonl" timeout 400 python3 -m prism_megatron run --prism-emulate \
    --prism-world-size 2 --prism-devices 0 --prism-slots-per-device 1 --prism-trace-dir "$out/trace-$name" \
    --prism-report off --prism-log-ranks none $driver $flags > "$out/emu-$name.log" 2>&1
  echo "$name emulated (2 ranks on GPU 0): exit $? in $(( $(date +%s) - t0 )) s"
done
# the OOM verdict around a measured peak: target = 0.9x and 1.1x of PP2 stage 0's real max reserved
if [ -s "$out/real-pp2.jsonl" ]; then
  for f in 0.9 1.1; do
    gib=$(python3 -c "import json;r=[json.loads(l) for l in open('$out/real-pp2.jsonl')];print(max(x['max_reserved'] for x in r if x['rank']==0)*$f/2**30)")
    timeout 300 python3 -m prism_megatron run --prism-emulate --prism-world-size 2 --prism-devices 0 \
      --prism-trace-dir "$out/trace-pp2-cap$f" --prism-target-gpu "$gib" --prism-target-context 0 \
      --prism-report off --prism-log-ranks none $driver $common ${layouts[pp2]} > "$out/emu-pp2-cap$f.log" 2>&1
    echo "pp2 capped at ${f}x stage 0's real peak ($gib GiB): exit $?"
  done
fi
python3 bench/gpu/memory_compare.py "$out" | tee "$out/compare.txt"
