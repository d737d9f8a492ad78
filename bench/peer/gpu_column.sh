#!/usr/bin/env bash
# One GPU's column of the peer table: Megatron-LM's test_parallel_state.py, pipeline_parallel/test_schedules.py,
# distributed/*.py and tensor_parallel/*.py as 8 logical ranks on one GPU, several files at once, in a bounded
# time, on a machine that cannot fetch Megatron-LM: the files come from an archive made beforehand with
#   python bench/peer/run_peer_suite.py --pack ARCHIVE   (2-3 MiB)
# Usage: bench/peer/gpu_column.sh ARCHIVE OUT [DEADLINE_S]   env: DEVICES (0), SLOTS (2), JOBS (4), PYTHON (python3), TIMEOUT (per file, 300 s),
#   FILES (test files or globs under the checkout, space-separated; default: the column's files below),
#   LAUNCH (options for prism-megatron launch; default "--swap none --gpu-timing off").
# Why --swap none: unit tests mark no training iterations, so under the launcher's --swap auto every slot turn is
# admitted with room for the whole device (nothing is known of the rank's peak yet) and the other ranks are
# checkpointed out and back in, about 7 swaps each way per test of 8 ranks (seconds per test on a GPU).
# These tests hold little device memory: shared without swaps they fit. GPU timing is of no use to a test.
# Writes OUT/table.txt, OUT/console.txt, OUT/raw.tar.gz (per-rank results), OUT/logs.tar.gz (per file:
# launcher output, rank logs, prism's reports). Ends within DEADLINE_S (default 360) plus about 40 s.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 ARCHIVE OUT [DEADLINE_S]" >&2; exit 2; }
archive=$(realpath "$1"); out=$(realpath -m "$2"); deadline=${3:-360}
mkdir -p "$out"
work=$(mktemp -d)
cd "$(dirname "$0")/../.."
# Megatron's test conftest downloads data sets when /opt/data is empty; without network, a proxy that refuses
# at once makes that fail fast (these files use no data) instead of waiting on name resolution in every rank
export HTTPS_PROXY=http://127.0.0.1:9 HTTP_PROXY=http://127.0.0.1:9 NO_PROXY=localhost,127.0.0.1 PYTHONUNBUFFERED=1
launch=()
for arg in ${LAUNCH---swap none --gpu-timing off}; do launch+=("--launch-arg=$arg"); done
"${PYTHON:-python3}" bench/peer/run_peer_suite.py -w 8 --devices "${DEVICES:-0}" --slots-per-device "${SLOTS:-2}" \
    --jobs "${JOBS:-4}" --deadline "$deadline" --timeout "${TIMEOUT:-300}" --megatron-lm "$archive" \
    --out "$out/table.txt" --raw "$work/raw" --logs "$work/logs" "${launch[@]}" \
    ${FILES:-tests/unit_tests/pipeline_parallel/test_schedules.py tests/unit_tests/test_parallel_state.py
    'tests/unit_tests/distributed/*.py' 'tests/unit_tests/tensor_parallel/*.py'} 2>&1 | tee "$out/console.txt"
rc=${PIPESTATUS[0]}
[ -d "$work/raw" ] && tar -czf "$out/raw.tar.gz" -C "$work" raw
[ -d "$work/logs" ] && tar -czf "$out/logs.tar.gz" -C "$work" logs
rm -rf "$work"
exit "$rc"
