#!/usr/bin/env bash
# Every target recipe, scaled down, end to end on CPU (issue 20): before GPU time is spent on a target,
# run the same command run_target.sh runs on the GPU (plan, then `run` with the class-depth fold captured
# serially, --prism-attention sdpa, micro-batches folded) with widths and lengths shrunk and the layout
# kept: TP/PP/VPP/EP/ETP, sequence parallelism, the layer count (so the pipeline split, VPP chunks and
# pipeline layout hold), the MoE layer pattern, MLA, QK layernorm, the dispatcher and the global batch
# (so micro-batch folding takes the same path), and the fold depth the GPU plan takes. Experts shrink only to a count EP still divides.
# What it cannot catch: seams only CPU mode installs (prism_megatron/megatron/cpu_mode.py, patches/
# cpu_trainer.py) and code only a GPU rank runs (two clocks, CUDA allocator, torch.compile'd fusions).
#
# Run from the repo root with a Python that has megatron-core installed (0.19.x: the GPU's version):
#   MEGATRON_LM_PATH=DIR_WITH_megatron/training PYTHON=python3 bash bench/targets/smoke_cpu.sh [NAME ...]
# env: PYTHON (python3), TIMEOUT (s per target run, 360), ITERS (train iterations, 2), OUT (/tmp/prism-smoke),
#   SUMMARY_ONLY (1: run nothing, print the blocks of the runs already in OUT), FLAGS (more flags for every target,
#   as run_target.sh takes them after the name: e.g. FLAGS='--prism-experts grouped' smokes a choice the recipe lacks).
# Prints one summary block per target; writes OUT/smoke-NAME/{plan.txt,run.log,times.txt,exit.txt,overrides.txt,flags.txt}
# and the trace (times.txt: prism's lines with the seconds since the run began, stamp_lines.py).
set -uo pipefail
: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout (the directory holding megatron/training)}"
py=${PYTHON:-python3}
outroot=${OUT:-/tmp/prism-smoke}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 WANDB_MODE=offline MEGATRON_LM_PATH

all=(llama3-8b-h100x8 llama3-70b-h100x64 llama31-405b-h100x512 llama31-405b-h100x8192 qwen3-30b-a3b-h100x16
     qwen3-235b-a22b-h100x256-tp1pp8ep32 qwen3-235b-a22b-h100x256-tp1pp8vpp4ep8
     qwen3-235b-a22b-h100x256-tp2pp8vpp4ep32 deepseek-v3-h100x1024)
[ $# -gt 0 ] && targets=("$@") || targets=("${all[@]}")

# The shrink common to all: widths and lengths only.
common=(--hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 8 --seq-length 64
        --max-position-embeddings 64 --vocab-size 1000 --train-iters "${ITERS:-2}")

shrink() {  # target -> its own overrides: query groups TP divides, experts EP divides, MLA dims, head dim
  case $1 in
    llama3-8b-*) echo --num-query-groups 2 ;;
    llama3-70b-*) echo --num-query-groups 4 ;;                       # TP4
    llama31-405b-*) echo --num-attention-heads 16 --num-query-groups 8 ;;  # TP8, GQA kept
    qwen3-30b-*) echo --num-query-groups 2 --kv-channels 8 --num-experts 16 --moe-ffn-hidden-size 32 ;;  # EP16
    qwen3-235b-*ep32) echo --num-query-groups 2 --kv-channels 8 --num-experts 32 --moe-ffn-hidden-size 32 ;;
    qwen3-235b-*ep8) echo --num-query-groups 2 --kv-channels 8 --num-experts 16 --moe-ffn-hidden-size 32 ;;
    deepseek-v3-*) echo --kv-channels 8 --num-experts 64 --moe-ffn-hidden-size 32 \
                        --moe-shared-expert-intermediate-size 32 --q-lora-rank 32 --kv-lora-rank 16 \
                        --qk-head-dim 8 --qk-pos-emb-head-dim 8 --v-head-dim 8 ;;  # EP64, MLA
    *) echo "smoke_cpu: no shrink for target $1" >&2; return 1 ;;
  esac
}

first_error() {  # the first line that says what went wrong
  grep -m1 -E "^[A-Za-z_.]*(Error|Exception)(:|$)|^Error:|^prism: .*(refused|error|failed|hang|mismatch)|OOM|out of memory" "$1" \
    || tail -1 "$1"
}

depth() {  # the fold depth the GPU plan takes for it (bench/targets/results/plan-h200-serial-moe-*.txt):
  # tiny shapes fit a replica here, so auto would take a path the GPU run does not
  case $1 in llama3-8b-*) echo replica ;; *) echo class ;; esac
}

summarize() {  # NAME: the block printed for one target, from OUT/smoke-NAME
  local name=$1 out=$outroot/smoke-$1 rc wall plan_rc overrides
  read -r rc wall plan_rc < "$out/exit.txt" || { echo "== $name: no result in $out"; return 1; }
  overrides=$(cat "$out/overrides.txt")
  echo "== $name: exit $rc in $wall s$([ "$rc" -eq 124 ] && echo " (timed out)")"
  echo "   overrides: $overrides"
  echo "   plan: exit $plan_rc; $(grep -m1 -E "^capture: serial|serial capture refused|does not fit" "$out/plan.txt" \
                                   | cut -c1-200 || echo "(no verdict line)")"
  grep -m1 -E "^prism: micro-batches" "$out/run.log" | cut -c8-200 | sed 's/^/   /'
  echo "   captures: $(grep -c -E "^prism: serial capture [0-9]+/[0-9]+: rank" "$out/run.log") started; $(grep -m1 -E \
       "^prism: serial capture: merged" "$out/run.log" | sed 's/,\{0,1\} into .*(/ (/; s/^prism: serial capture: //' \
       || echo "none merged")"
  if [ "$rc" -eq 0 ]; then
    grep -m1 -E "^predicted iteration" "$out/run.log" | sed 's/^/   /'
    grep -m1 -E "^fits:|^OOM|does not fit" "$out/run.log" | sed 's/^/   /'
  else
    [ "$plan_rc" -ne 0 ] && echo "   plan error: $(first_error "$out/plan.txt" | cut -c1-240)"
    if [ "$rc" -eq 124 ]; then
      echo "   timed out; last prism line: $(grep "^prism:" "$out/run.log" | tail -1 | cut -c1-200)"
    else
      echo "   error: $(first_error "$out/run.log" | cut -c1-240)"
    fi
  fi
  return $(( rc != 0 ))
}

failed=0
for name in "${targets[@]}"; do
  out=$outroot/smoke-$name
  if [ -z "${SUMMARY_ONLY:-}" ]; then  # SUMMARY_ONLY=1: print the blocks of runs already in OUT
    rm -rf "$out" && mkdir -p "$out"
    read -r -a own <<< "$(shrink "$name")" || { failed=$((failed + 1)); continue; }
    # attention, serial capture and micro-batch fold: the recipe's emulation section, as on the GPU
    flags=(--recipe "targets-$name" --prism-devices cpu --prism-driver training --prism-fold on
           --prism-fold-depth "$(depth "$name")" "${common[@]}" "${own[@]}")
    read -r -a more <<< "${FLAGS:-}"
    flags+=("${more[@]}")
    echo "${common[*]} ${own[*]} ${more[*]}" > "$out/overrides.txt"
    echo "${flags[*]}" > "$out/flags.txt"  # the whole command's flags (report_step_model.py plans them again)
    "$py" -m prism_megatron plan "${flags[@]}" > "$out/plan.txt" 2>&1
    plan_rc=$?
    t0=$(date +%s)
    timeout "${TIMEOUT:-360}" "$py" -m prism_megatron run "${flags[@]}" --prism-emulate \
      --prism-trace-dir "$out/trace" 2>&1 | "$py" -u "$(dirname "$0")/stamp_lines.py" "$out/times.txt" > "$out/run.log"
    rc=${PIPESTATUS[0]}
    echo "$rc $(( $(date +%s) - t0 )) $plan_rc" > "$out/exit.txt"
  fi
  summarize "$name" || failed=$((failed + 1))
done
echo "== smoke_cpu: ${#targets[@]} target(s), $failed failed"
exit $(( failed > 0 ))
