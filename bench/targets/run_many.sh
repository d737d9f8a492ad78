#!/usr/bin/env bash
# Several target recipes emulated on the GPU one after another (issue 20) within a total budget: each is
# run_target.sh's run, given what is left as its BUDGET, so a target the plan expects to outlast the rest
# is skipped (run_target.sh exit 3) and a started one is cut at what is left. Each target's summary lands
# in OUT/target-NAME/summary.txt as it finishes and its one-line verdict in OUT/run_many.txt, so a device
# call cut off midway still returns what finished. Each target's folder is then packed as
# OUT/target-NAME.tar.gz (run_target.sh's PACK=1). Run from the repo root, set up as for run_target.sh:
#   bash bench/targets/run_many.sh 560 llama3-8b-h100x8 llama31-405b-h100x512 [...] [-- more flags]
# TOTAL (first argument, s) should leave the device call's own limit room for the start and the transfers.
# env: as run_target.sh (ARCHIVE, DEVICES, TIMEOUT per target, OUT, SLACK, PLAN=0: no plan per target, so none is
# skipped for its expected time, each is cut at what is left); MIN_LEFT (s, 60): stop below it.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 TOTAL_SECONDS NAME [NAME ...] [-- flags for every target]" >&2; exit 2; }
total=$1; shift
names=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do names+=("$1"); shift; done
[ $# -gt 0 ] && shift  # the rest: flags for every target
export OUT=${OUT:-/tmp/prism-gpu}
mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
t0=$(date +%s)
status=0
for name in "${names[@]}"; do
  left=$(( total - ($(date +%s) - t0) ))
  if [ "$left" -lt "${MIN_LEFT:-60}" ]; then
    echo "== $name: not started: ${left} s of ${total} s left" | tee -a "$OUT/run_many.txt"
    status=1
    continue
  fi
  start=$(date +%s)
  PACK=1 BUDGET=$left bash "$here/run_target.sh" "$name" "$@"
  rc=$?
  case $rc in
    0) verdict="done" ;;
    5) verdict="done: out of memory on the target (a prediction: the report names each failing allocation)" ;;
    3) verdict="skipped (plan's expected time exceeds the ${left} s left)"; status=1 ;;
    124|137) verdict="cut off at the time left (exit $rc)"; status=1 ;;
    *) verdict="failed (exit $rc)"; status=1 ;;
  esac
  echo "== $name: $verdict in $(( $(date +%s) - start )) s; $(( total - ($(date +%s) - t0) )) s left" \
    | tee -a "$OUT/run_many.txt"
done
exit "$status"  # 0: every target ran to the end
