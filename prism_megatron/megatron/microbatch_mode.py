"""``--prism-fold-microbatches``: how many of the target's micro-batches a run captures per iteration.

The target runs M = global batch / (micro batch x DP) micro-batches per pipeline and iteration. Every
stage's micro-batches between its warm-up and the last ones do the same work on the same shapes, so
the run captures m_c of them and replay gives every rank the target's M (replay.microbatch_fold; the
rules and minimums in trace.microbatches): under Megatron's non-interleaved schedules m_c = the
largest warm-up + 2 (PP1: 3); under its interleaved schedule (VPP) m_c = M less whole micro-batch
groups (``microbatch_group_size_per_vp_stage``), at least the first group, a steady group and the last
(3 groups at Megatron-LM's default group of PP), so Megatron's rules on M hold for m_c. The ranks are
given the same command with ``--global-batch-size`` m_c x micro batch x DP (appended once: Megatron's
parser keeps the last value), and the trace's ``job.microbatches`` records M, m_c and the rule.

Refused, naming the flag: a batch-size ramp-up (M changes between iterations), sample-based training
(``--train-samples``: the iteration count follows from the global batch), evaluation during the run
(forward-only iterations are not expanded), and a count N that is not one the rules allow.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["MicrobatchModeError", "parse_value", "choose_microbatches"]


class MicrobatchModeError(ValueError):
    """The micro-batch fold asked for cannot be run; the message names the value or flag."""


def parse_value(value: str) -> str | int:
    """'auto', 'off' or N >= 1 (``--prism-fold-microbatches``)."""
    if value in ("auto", "off"):
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise MicrobatchModeError(f"--prism-fold-microbatches {value!r}: expected auto, off or a number of "
                                  "micro-batches >= 1")
    return n


def _arg(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def choose_microbatches(value: str, script: Path, script_args: list[str], world_size: int,
                        gpus_per_node: int = 8, env: dict[str, str] | None = None,
                        say: Callable[[str], None] = print, args: Any = None) -> tuple[list[str], dict | None]:
    """(the ranks' command line, the manifest's ``job.microbatches`` record or None) under
    ``--prism-fold-microbatches value``. ``args``: Megatron's parsed args (else parsed here)."""
    from prism_megatron.megatron.fold import FoldError, layout_from_args, pipeline_schedule
    from prism_megatron.trace.microbatches import MicrobatchFold, minimum_captured, minimum_interleaved

    mode = parse_value(value)
    if mode == "off":
        return list(script_args), None
    flag = f"--prism-fold-microbatches {value}"
    if args is None:
        from prism_megatron.megatron.megatron_args import ArgsError, parse_megatron_args

        try:
            args = parse_megatron_args(script, list(script_args), world_size, env)
        except ArgsError as e:
            raise MicrobatchModeError(f"{flag}: {e}") from None
    if _arg(args, "rampup_batch_size"):
        raise MicrobatchModeError(f"{flag}: --rampup-batch-size {' '.join(map(str, args.rampup_batch_size))}: the "
                                  "micro-batch count changes between iterations; run with "
                                  "--prism-fold-microbatches off")
    if _arg(args, "train_samples"):
        raise MicrobatchModeError(f"{flag}: --train-samples {args.train_samples}: the iteration count follows from the "
                                  "global batch, which the fold changes; give --train-iters or run with "
                                  "--prism-fold-microbatches off")
    train, interval, evals = _arg(args, "train_iters", 0), _arg(args, "eval_interval", 0), _arg(args, "eval_iters", 0)
    if evals and interval and train >= interval and not _arg(args, "skip_train", False):
        raise MicrobatchModeError(f"{flag}: --eval-iters {evals} with --eval-interval {interval} evaluates within "
                                  f"the {train} iterations, and forward-only iterations are not expanded to the "
                                  "target's micro-batches; give --eval-iters 0 or run with "
                                  "--prism-fold-microbatches off")
    try:
        layout = layout_from_args(args, world_size, gpus_per_node)
        schedule = pipeline_schedule(layout)
    except FoldError as e:
        raise MicrobatchModeError(f"{flag}: {e}") from None
    mbs, gbs, dp = int(_arg(args, "micro_batch_size", 1)), _arg(args, "global_batch_size"), layout.dp
    if not gbs or gbs % (mbs * dp):
        raise MicrobatchModeError(f"{flag}: --global-batch-size {gbs} is not a multiple of micro batch {mbs} x "
                                  f"DP{dp}")
    m = gbs // (mbs * dp)
    interleaved = schedule["name"] == "interleaved"
    if interleaved:
        chunks, group, pp = int(schedule["chunks"]), int(schedule["group"]), len(schedule["warmup"])
        if group > m or 0 < m % group < pp:
            raise MicrobatchModeError(f"{flag}: {m} micro-batches per iteration (global batch {gbs} / (micro batch "
                                      f"{mbs} x DP{dp})) with micro-batch groups of {group}: Megatron's interleaved "
                                      f"schedule needs a group <= M and a remainder of M by it of 0 or >= PP{pp}")
        least = minimum_interleaved(schedule["warmup"], chunks, group, m)
        rule = (f"the first group, a steady group and the last group, over warm-ups up to "
                f"{max(schedule['warmup'])} of {chunks} chunks")
    else:
        least = minimum_captured(schedule["warmup"])
        rule = f"largest warm-up {max(schedule['warmup'])} + 2, at least 3"
    if mode == "auto":
        if m <= least:
            say(f"micro-batches auto: all {m} run per iteration (folding needs more than {least}: "
                f"{'an interleaved pipeline needs ' + rule if interleaved else 'the largest warm-up + 2'})")
            return list(script_args), None
        captured = least
    else:
        captured = int(mode)
        if captured > m:
            raise MicrobatchModeError(f"{flag}: {captured} micro-batches per iteration is more than the target's "
                                      f"{m} (global batch {gbs} / (micro batch {mbs} x DP{dp}))")
        if captured < least:
            what = ("every stage must run its warm-up, a steady group whose units stand for the missing ones, and "
                    "its cool-down" if interleaved else
                    "every stage must run its warm-up, a steady pair and its own last micro-batch")
            raise MicrobatchModeError(f"{flag}: {captured} micro-batches per iteration is below the minimum {least} "
                                      f"({rule}): {what}")
        if interleaved and (m - captured) % group:
            lower = captured - (captured - least) % group
            raise MicrobatchModeError(f"{flag}: {captured} micro-batches per iteration is not the target's {m} less "
                                      f"a multiple of the micro-batch group {group} (whole groups are replayed): "
                                      f"give {lower} or {lower + group}")
        if captured == m:
            say(f"micro-batches: all {m} run per iteration (--prism-fold-microbatches {captured} is the target's)")
            return list(script_args), None
    extra = ({"chunks": chunks, "group": group, "overlap_p2p": bool(schedule["overlap_p2p"]),
              "wait_sends": bool(schedule["wait_sends"])} if interleaved else {})
    record = MicrobatchFold(m, captured, schedule["name"], tuple(int(x) for x in schedule["warmup"]), **extra)
    say(f"{record.describe()} (global batch {gbs} run as {captured * mbs * dp})")
    return [*script_args, "--global-batch-size", str(captured * mbs * dp)], record.to_json()
