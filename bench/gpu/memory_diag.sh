#!/usr/bin/env bash
# Where emulated and real peaks differ: TP2 (2 iterations) real and emulated with allocation history
# (PRISM_MEMORY_SNAPSHOT). Analyse: python3 bench/gpu/snapshot_diff.py OUT/real-rank0.pickle OUT/emu-rank0.pickle
set -uo pipefail
out=${1:-/tmp/prism-mem}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
driver=prism_megatron/megatron/driver/core_gpt.py
common="--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024
 --tokenizer-type NullTokenizer --vocab-size 32000 --mock-data --micro-batch-size 4 --global-batch-size 16
 --train-iters 2 --lr 1e-4 --seed 1234 --optimizer adam --transformer-impl local
 --no-gradient-accumulation-fusion --log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0
 --bf16 --no-masked-softmax-fusion --tensor-model-parallel-size 2"
PRISM_MEMORY_SNAPSHOT=$out/real PRISM_MEGATRON_METRICS=$out/real-tp2.jsonl timeout 200 python3 -m torch.distributed.run \
  --nproc-per-node 2 --master-port 29801 $driver $common > "$out/real-tp2.log" 2>&1; echo "real tp2: exit $?"
PRISM_MEMORY_SNAPSHOT=$out/emu PRISM_MEGATRON_METRICS=$out/emu-tp2.jsonl timeout 300 python3 -m prism_megatron run \
  --prism-emulate --prism-world-size 2 --prism-devices 0 --prism-trace-dir "$out/trace-tp2" --prism-report off \
  --prism-log-ranks none $driver $common > "$out/emu-tp2.log" 2>&1; echo "emulated tp2: exit $?"
