# Sourced by the target scripts on the GPU machine (run_target.sh, fake_pg_peak.sh), after `name` is set:
# OUT/target-NAME as `out`, a scratch directory `work` (the caller removes it), Megatron-LM's training loop
# unpacked from ARCHIVE (.peer-cache/megatron-lm-core_v0.19.0.tar.gz, made by `run_peer_suite.py --pack`) as
# MEGATRON_LM_PATH, megatron-core from /tmp/site, and the environment both scripts run under.
out=${OUT:-/tmp/prism-gpu}/target-$name
work=$(mktemp -d)
mkdir -p "$out"
archive=${ARCHIVE:-.peer-cache/megatron-lm-core_v0.19.0.tar.gz}
mkdir -p "$work/mlm" && tar -xzf "$archive" -C "$work/mlm" || { echo "cannot unpack $archive" >&2; exit 2; }
export MEGATRON_LM_PATH=$work/mlm PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export WANDB_MODE=offline
