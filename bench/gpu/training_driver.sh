#!/usr/bin/env bash
# Issue 3's GPU check for megatron-core 0.19.x (device `nvidia-h200-x2`, ~2 min): the training driver
# (megatron.training.pretrain through 0.19's config container) runs a tiny TP2 GPT twice: as 2 real
# NCCL processes on 2 GPUs (torchrun) and as 2 logical ranks emulated on GPU 0. Prints Megatron's
# per-iteration loss and grad norm of both (the numerics contract on a GPU: they should agree to
# the printed digits up to NCCL's reduction order). Run from the repo root with .whl carried:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   bash bench/gpu/training_driver.sh
set -uo pipefail
out=${OUT:-/tmp/prism-gpu}/training-driver
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_MODE=disabled
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
script=prism_megatron/megatron/driver/pretrain_gpt_mini.py
flags="--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128
  --tokenizer-type NullTokenizer --vocab-size 1024 --mock-data --micro-batch-size 2 --global-batch-size 8
  --train-iters 4 --lr 0.0001 --seed 1234 --tensor-model-parallel-size 2 --transformer-impl local
  --no-gradient-accumulation-fusion --log-interval 1 --eval-iters 0 --eval-interval 1000"
show() {
  grep -E "iteration +[0-9]+/" "$1" | sed -E 's/.*(iteration +[0-9]+).*(lm loss: [^|]*).*(grad norm: [^|]*).*/\1 \2 \3/'
  grep -m3 -E "Error|error:" "$1"
}
timeout 240 python3 -m torch.distributed.run --nproc-per-node=2 --master-port=29561 $script $flags \
  > "$out/real.log" 2>&1; echo "real (torchrun, 2 GPUs): exit $?"; show "$out/real.log"
timeout 240 python3 -m prism_megatron run --prism-emulate --prism-world-size 2 --prism-devices 0 \
  --prism-trace-dir /tmp/training-driver-trace $script $flags > "$out/emulated.log" 2>&1
echo "emulated (2 logical ranks, GPU 0): exit $?"; show "$out/emulated.log"
