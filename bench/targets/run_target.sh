#!/usr/bin/env bash
# One target recipe emulated end to end on one GPU (issue 20), as its recipe's emulation section has it:
# folded and captured serially (one live rank at a time), fused attention in place of Transformer Engine's
# (--prism-attention sdpa), micro-batches folded; then the report. Prints the plan, the run's own lines, the
# emulation's wall time and the peak GPU and host memory in use, sampled every second while it ran.
# Run from the repo root on the GPU machine, megatron-core installed into /tmp/site by the caller and the
# Megatron-LM archive made by `bench/peer/run_peer_suite.py --pack` carried (Megatron-LM's training loop):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   bash bench/targets/run_target.sh llama3-70b-h100x64 [more prism or Megatron flags]
# env: ARCHIVE (.peer-cache/megatron-lm-core_v0.19.0.tar.gz), DEVICES (0), TIMEOUT (s, 480; BUDGET where set), OUT (/tmp/prism-gpu);
#   KEEP_TRACE=1: also write the trace (rank logs left out) as OUT/target-NAME/trace.tar.gz for offline analysis;
#   BUDGET (s left when it starts, unset: no limit): skip the run (exit 3) when the plan's expected emulation time times SLACK
#   (2.5: the Llama-3-70B run took 2.5x the plan's figure) exceeds it, and cap TIMEOUT at it (run_many.sh sets it);
#   PLAN=0: no plan first (it takes ~45 s on the H200 machine); with BUDGET the run then starts whatever its expected
#   time and is cut at what is left;
#   KEEP_CAPTURES=1: also write the serial captures' traces (rank logs left out) as OUT/target-NAME/captures.tar.gz;
#   CAPTURES=FILE: such an archive from an earlier call of the same command: unpacked beside the trace and the run
#   resumed (--prism-fold-resume reuses each capture it finished on the same machine and software, runs the rest);
#   PACK=1: pack OUT/target-NAME as OUT/target-NAME.tar.gz at the end (a captures archive stays where it is, for a
#   resume on the same machine): a device call brings back a few files, so two runs' folders do not all come back.
# Writes OUT/target-NAME/{run.log,times.txt,memory.txt,host_probe.txt,summary.txt} (times.txt: prism's lines with the seconds since
# the run began, stamp_lines.py), the report beside the trace (report.json) and, where
# wandb is installed, its offline run (wandb.tar.gz, sync it with `wandb sync`); where a
# second pass took a class again, second_pass.txt (bench/targets/second_pass_effect.py: what each take changed).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 NAME [flags]" >&2; exit 2; }
name=$1; shift
started=$(date +%s)
. "$(dirname "$0")/setup.sh"
pack() {  # PACK=1, however the script ends: a device call brings back a few files, not folders of them
  [ "${PACK:-0}" = 1 ] && [ -d "$out" ] || return 0
  tar -czf "$out.tar.gz" -C "$(dirname "$out")" --exclude=captures.tar.gz "$(basename "$out")" \
    && find "$out" -mindepth 1 -not -name captures.tar.gz -delete
}
trap pack EXIT
# The issue's command: the recipe's own emulation section chooses the rest (SDPA attention, serial capture,
# micro-batches folded) and the run prints each choice; the fold is auto (the full job never fits one GPU).
flags=(--recipe "targets-$name" --prism-devices "${DEVICES:-0}" --prism-driver training "$@")
if [ -n "${CAPTURES:-}" ]; then  # an earlier call's finished captures: resumed
  tar -xzf "$CAPTURES" -C "$work" || { echo "cannot unpack $CAPTURES" >&2; rm -rf "$work"; exit 2; }
  flags+=(--prism-fold-resume)
fi
[ "${PLAN:-1}" = 0 ] || python3 -m prism_megatron plan "${flags[@]}" 2>&1 | grep -v -i "warn" | tee "$out/plan.txt"
timeout=${TIMEOUT:-${BUDGET:-480}}  # run_many.sh: its BUDGET, not 480 s, unless TIMEOUT says otherwise
if [ -n "${BUDGET:-}" ]; then  # run_many.sh: BUDGET s were left at the start; the run is cut at what is left
  left=$(( BUDGET - ($(date +%s) - started) ))
  if [ "${PLAN:-1}" != 0 ]; then  # and skipped where the plan expects it to outlast them
    minutes=$(sed -n 's/^expected emulation time: ~\([0-9.]*\) min.*/\1/p' "$out/plan.txt" | head -1)
    [ -n "$minutes" ] || { echo "== $name: the plan failed (no expected time)" | tee "$out/summary.txt"; rm -rf "$work"; exit 2; }
    need=$(awk -v m="$minutes" -v k="${SLACK:-2.5}" 'BEGIN {printf "%d", m * 60 * k + 0.5}')
    if [ "$need" -gt "$left" ]; then
      echo "== $name: skipped: the plan expects $minutes min (x${SLACK:-2.5} = $need s), $left s left" \
        | tee "$out/summary.txt"
      rm -rf "$work"
      exit 3
    fi
  fi
  [ "$left" -lt "$timeout" ] && timeout=$left
fi
sample() {  # peak GPU memory used (MiB) and host memory used (MiB), once a second
  local gpu=0 host=0 g h
  while :; do
    g=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i "${DEVICES:-0}" 2>/dev/null | head -1)
    h=$(free -m | awk '/^Mem:/ {print $3}')
    [ -n "$g" ] && [ "$g" -gt "$gpu" ] && gpu=$g
    [ -n "$h" ] && [ "$h" -gt "$host" ] && host=$h
    echo "peak GPU memory used: ${gpu} MiB; peak host memory used: ${host} MiB" > "$out/memory.txt"
    sleep 1
  done
}
# the host's own speed, recorded beside the prediction (a host-bound rank's time is its host's: host_probe.py)
python3 "$(dirname "$0")/../gpu/host_probe.py" > "$out/host_probe.txt" 2>&1 || echo "host probe failed" >> "$out/host_probe.txt"
sample & sampler=$!
t0=$(date +%s)
timeout "$timeout" python3 -m prism_megatron run "${flags[@]}" --prism-emulate \
  --prism-trace-dir "$work/trace" 2>&1 | python3 -u "$(dirname "$0")/stamp_lines.py" "$out/times.txt" > "$out/run.log"
rc=${PIPESTATUS[0]}
kill "$sampler" 2>/dev/null
{ echo "== $name: exit $rc in $(( $(date +%s) - t0 )) s (flags: ${flags[*]})"
  cat "$out/memory.txt" "$out/host_probe.txt"
  grep -E "^prism: (serial capture|micro-batches|fold|done|report)|iteration +[0-9]+/" "$out/run.log" | cut -c1-300
  sed -n '/^prism-megatron report of/,$p' "$out/run.log"  # the run's own report (its cluster profile costs comm)
} | tee "$out/summary.txt"
cp "$work/trace/report.json" "$out/" 2>/dev/null
if compgen -G "$work/trace.captures/capture-*-take-*" > /dev/null; then  # a second pass ran: what it changed
  python3 "$(dirname "$0")/second_pass_effect.py" "$work/trace.captures" 2>&1 | tee "$out/second_pass.txt" \
    | tee -a "$out/summary.txt"
fi
if [ -d "$work/wandb" ]; then  # the offline W&B run(s) the report wrote, less files over 4 MiB (a timeline's copy)
  (cd "$work" && find wandb -type f -size -4M -print0 | tar -czf "$out/wandb.tar.gz" --null -T -)
fi
[ "${KEEP_TRACE:-0}" = 1 ] && tar -czf "$out/trace.tar.gz" -C "$work" --exclude='*.logs' trace
[ "${KEEP_CAPTURES:-0}" = 1 ] && [ -d "$work/trace.captures" ] && \
  tar -czf "$out/captures.tar.gz" -C "$work" --exclude='*.logs' trace.captures
rm -rf "$work"
exit "$rc"
