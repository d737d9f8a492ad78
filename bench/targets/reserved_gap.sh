#!/usr/bin/env bash
# Where one rank's max reserved differs between Megatron's own --fake-process-group and prism (issue 20: Llama-3-70B's
# first stage reserved 5.2 GiB more under the fake process group with max allocated equal to 512 B): both record the
# CUDA allocator's history (PRISM_MEMORY_SNAPSHOT), then bench/gpu/snapshot_diff.py lists the stacks whose segments
# one run reserved and the other did not, at each run's peak. Run from the repo root on the GPU machine, megatron-core
# installed into /tmp/site by the caller:
#   bash bench/targets/reserved_gap.sh llama3-70b-h100x64 [RANK (0)]
# env: OUT (/tmp/prism-gpu), ITERS (2), PRISM_TIMEOUT (s, 200: prism's run may be cut once RANK's capture ended),
# PRISM_FLAGS (more flags for prism's run only, e.g. --no-check-for-nan-in-loss-and-grad, which Megatron sets
# itself under --fake-process-group), TAG (a suffix for the result file's name), FAKE_AGAIN (1: the fake process
# group runs again after prism, its caches then warm like prism's, and the diffs compare it with its first run
# and with prism: whether the fake run's own reserved repeats, docs/measurements.md "Target recipes").
# Writes OUT/reserved-gap-NAME-rankR.txt (both runs' summaries and the diff); the pickles (hundreds of MB) are
# removed once read.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 NAME [RANK]" >&2; exit 2; }
name=$1; rank=${2:-0}; iters=${ITERS:-2}
export OUT=${OUT:-/tmp/prism-gpu}
snap=$(mktemp -d)
result=$OUT/reserved-gap-$name-rank$rank${TAG:+-$TAG}.txt
fake_run() {  # the fake process group's run of RANK, its allocator history in $snap/$1-rankR.pickle
  PRISM_MEMORY_SNAPSHOT=$snap/$1 SCRIPT=driver TIMEOUT=240 bash bench/targets/fake_pg_peak.sh "$name" \
    --ranks "$rank" --iters "$iters" 2>&1 | grep -v -i warn | tail -8
}
{
  echo "# $name rank $rank, $iters iterations each: the fake process group, then prism's serial capture${PRISM_FLAGS:+ with $PRISM_FLAGS}"
  fake_run fakepg
  PRISM_MEMORY_SNAPSHOT=$snap/prism PLAN=0 TIMEOUT=${PRISM_TIMEOUT:-200} bash bench/targets/run_target.sh "$name" --train-iters "$iters" ${PRISM_FLAGS:-} \
    >/dev/null 2>&1
  echo "prism: exit $? ($(head -1 "$OUT/target-$name/summary.txt" 2>/dev/null))"
  ls -la "$snap"
  python3 bench/gpu/snapshot_diff.py "$snap/fakepg-rank$rank.pickle" "$snap/prism-rank$rank.pickle" --names fakepg,prism
  if [ "${FAKE_AGAIN:-0}" = 1 ]; then
    echo "== the fake process group again, after prism"
    fake_run fakepg2
    python3 bench/gpu/snapshot_diff.py "$snap/fakepg-rank$rank.pickle" "$snap/fakepg2-rank$rank.pickle" --names fakepg,fakepg2
    python3 bench/gpu/snapshot_diff.py "$snap/fakepg2-rank$rank.pickle" "$snap/prism-rank$rank.pickle" --names fakepg2,prism
  fi
} 2>&1 | tee "$result"
rm -rf "$snap"
