#!/usr/bin/env bash
# Megatron's own --fake-process-group memory peak for a target recipe's ranks, on the GPU machine (issue 20):
# each rank alone, Megatron-LM's pretrain_gpt.py with the arguments prism's ranks get and prism's rendering
# seams (bench/targets/fake_pg_peak.py says what runs). Beside prism's figure when OUT/target-NAME/report.json
# (run_target.sh's) exists. Run from the repo root, megatron-core installed into /tmp/site by the caller:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   bash bench/targets/fake_pg_peak.sh llama3-8b-h100x8 [--ranks 0,3] [fake_pg_peak.py flags] [-- MEGATRON FLAGS]
# env: ARCHIVE (.peer-cache/megatron-lm-core_v0.19.0.tar.gz), SCRIPT (pretrain_gpt.py, default: the archive's;
#   'driver': prism's training driver), DEVICES (0: the GPU every rank runs on, one after another), TIMEOUT (s per
#   rank, 540), OUT (/tmp/prism-gpu).
# Writes OUT/target-NAME/fake-pg-NAME.json, its per-rank logs and fake-pg.txt (the table).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 NAME [fake_pg_peak.py flags]" >&2; exit 2; }
name=$1; shift
. "$(dirname "$0")/setup.sh"
export CUDA_VISIBLE_DEVICES=${DEVICES:-0}
flags=(--out "$out" --timeout "${TIMEOUT:-540}")
[ -n "${SCRIPT:-}" ] && flags+=(--script "$SCRIPT")
[ -f "$out/report.json" ] && flags+=(--prism-report "$out/report.json")
python3 bench/targets/fake_pg_peak.py "$name" "${flags[@]}" "$@" 2>&1 | tee "$out/fake-pg.txt"
rc=${PIPESTATUS[0]}
rm -rf "$work"
exit "$rc"
