"""A folded run captured class by class (``--prism-fold-capture serial``): one capture per live rank, merged.

A fold at class depth keeps one live rank per rank class (first, middle, last pipeline stage); at the
targets' sizes each holds much of a device, so they need not fit this machine together. Serially, capture i runs
only live rank L_i as a process: its plan (:func:`capture_plan`) makes every other rank virtual, the other
live ranks too, each represented by L_i. The coordinator answers a virtual member whose class's live rank
is not L_i by self mirror (``nccl_prune.SELF_MIRROR_RULE``) and a receive from a virtual pipeline neighbour
by a stand-in of the posted shape (``nccl_prune.STANDIN_RULE``); L_i's own program, shapes and memory are
those of a capture together. A broadcast from such a root is answered from the earlier captures' recordings
(``runtime.folding.RECORDED_BROADCAST_RULE``: each capture's trace lists the broadcasts its class rooted,
the next captures' plans carry them), so a middle stage learns rank 0's do_train flags. A capture whose
live rank ran no iteration while another's did is incomplete, by name: its program ended early. Each
capture writes its own trace (``TRACE.captures/capture-I-rank-L``;
logs beside it), a failed one marked incomplete; the run stops at the first capture that fails and the
merged trace (``trace.merge``) says which. A capture whose rank ran out of memory under the target GPU's cap
(exit code ``OOM``) did not fail: its OOM is the prediction for its class, so the later captures run and the
merged trace holds every class, each with its peak or its failing allocation (``OOM_CONTINUES_RULE``).
Captures run in the fold's live-rank order (first stage first); a capture whose stand-ins had no recorded
norm, or whose small reductions over other classes found no recording of their inputs
(``nccl_prune.RECORDED_REDUCTION_RULE``; their senders are captured later) is captured again after them, latest first
(``nccl_prune.SECOND_PASS_RULE``), and its second trace is the one merged, where ``--prism-fold-second-pass``
takes it (:func:`second_pass`: under auto only for a fold with MoE layers); what was skipped is said and recorded.
A capture's ranks see ``CAPTURE_ENV``: rules the program side keeps for a capture of one live rank install
on it (Megatron's tied-embedding initialisation: ``patches.serial_embedding``). Take 1 of capture I writes
``capture-I-rank-L``, a later take N ``capture-I-rank-L-take-N`` (:func:`take_dir`), so that a run resumed under
``--prism-fold-resume`` finds every take an earlier run finished (``RESUME_RULE``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prism_megatron.launcher.config import LaunchConfig
from prism_megatron.launcher.exit_codes import OOM, RANK_FAILED
from prism_megatron.options import JobOptions, RunOnlyOptions, option
from prism_megatron.trace.fold import SERIAL_RULES, second_pass_skipped
from prism_megatron.trace.takes import routing_change

__all__ = ["CAPTURE_ENV", "OOM_CONTINUES_RULE", "RESUME_IGNORES", "RESUME_RULE", "capture_plan", "captures_dir",
           "capture_serially", "merged_line", "resumable", "second_pass", "take_dir"]

#: set to "serial" in the ranks of a serial capture (``rank.rank_env``): program-side rules that only a capture
#: of one live rank needs install on it (e.g. ``patches.serial_embedding``)
CAPTURE_ENV = "PRISM_FOLD_CAPTURE"

OOM_CONTINUES_RULE = """\
A serial capture whose live rank ran out of memory under the target GPU's cap (exit code OOM, its trace written
with the oom mark) is its class's verdict, not a failure of the run: the next captures run. What they need
from it are the broadcasts it recorded (RECORDED_BROADCAST_RULE), kept up to its OOM; one it never reached is
absent, and a later capture that needs it is refused by name as for any missing recording. Any other failure
(a crash, a refusal, a hang, the physical device's OOM, no trace written) stops the run as before. The run
exits as a run together with a predicted OOM does (OOM), unless a capture failed (its code)."""


RESUME_RULE = """\
Under --prism-fold-resume a serial run reuses the trace an earlier run left for a take of a capture (its place:
take_dir) instead of capturing it again, where that trace
- completed, or ended with its live rank's predicted OOM under the target's cap (its class's verdict), and
- was made by the same capture: its fold record is the capture plan this run gives it (the fold's, the capture's
  index, and the recordings of the earlier captures it is given), and its job record is this capture's (the script
  by file name, its flags but those in RESUME_IGNORES, world size, devices, target GPU, micro-batch fold,
  substitutions, cluster) on the same machine and software (GPU and CPU models, cores, Python, torch,
  megatron-core).
What it recorded for later captures is read from it as from a capture just run, so each later capture is given
what it would have been given. Any other trace there is captured again, and the run says why (the first
difference); the merged trace marks each reused capture (``reused``) and keeps its run's id and wall time."""

#: Options that say where a run writes, listens or what it prints, not what its ranks compute: a resumed capture's
#: command may differ from the earlier run's in these (RESUME_RULE).
RESUME_IGNORES: tuple[tuple[type, str], ...] = (
    (JobOptions, "trace_dir"), (JobOptions, "listen"), (JobOptions, "hang_timeout"), (JobOptions, "log_ranks"),
    (RunOnlyOptions, "fold_resume"), (RunOnlyOptions, "report"), (RunOnlyOptions, "timeline"))


def take_dir(root: Path, index: int, rank: int, take: int) -> Path:
    """Where take ``take`` (from 1) of capture ``index`` (of live rank ``rank``) writes its trace, under ``root``
    (:func:`captures_dir`)."""
    return root / (f"capture-{index}-rank-{rank}" + (f"-take-{take}" if take > 1 else ""))


def _command(args: list[str]) -> list[str]:
    """A rank's command line without the RESUME_IGNORES flags (and their values)."""
    ignored = {option(cls, name) for cls, name in RESUME_IGNORES}
    flags = {o.prism_flag: not o.is_switch for o in ignored}
    out, i = [], 0
    while i < len(args):
        name = args[i].partition("=")[0]
        if name in flags:
            i += 2 if flags[name] and "=" not in args[i] else 1
            continue
        out.append(args[i])
        i += 1
    return out


def _normal(value: Any) -> Any:
    """``value`` as its JSON reads back (tuples as lists, keys as strings): what a trace holds."""
    return json.loads(json.dumps(value))


def resumable(trace: Path, cfg: LaunchConfig) -> tuple[int, float] | str:
    """Whether the trace at ``trace`` is the take that ``cfg`` (one capture's launch) would make (RESUME_RULE):
    (its exit code: 0, or OOM for a predicted OOM; its wall time in s), else why not."""
    from prism_megatron.launcher.launch import job_record
    from prism_megatron.runtime.folding import RECORDED_PART_KEYS

    path = trace / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        job = dict(manifest["job"])
        live = int(cfg.fold["capture"]["part"]["rank"])
        codes = {int(r["rank"]): r.get("exit_code") for r in manifest["ranks"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{path} cannot be read as a capture's manifest ({type(e).__name__}: {e})"
    if manifest.get("complete") is not True:
        if codes.get(live) != OOM:
            return f"it did not complete ({manifest.get('incomplete')})"
    want = _normal(job_record(cfg))
    have = _normal(job)
    want["script"], have["script"] = Path(want["script"]).name, Path(str(have.get("script"))).name
    want["args"], have["args"] = _command(want["args"]), _command(list(have.get("args") or []))
    for key in sorted(set(want) - {"argv"}):
        if have.get(key) != want[key]:
            return f"its job's {key!r} differs ({_short(have.get(key))} there, {_short(want[key])} here)"
    fold = {k: v for k, v in (have.get("fold") or {}).items() if k != "contributions"}
    capture = dict(fold.get("capture") or {})
    capture["part"] = {k: v for k, v in (capture.get("part") or {}).items() if k not in RECORDED_PART_KEYS}
    fold["capture"] = capture
    planned = _normal(cfg.fold)
    for key in sorted(set(planned) | set(fold)):
        if fold.get(key) != planned.get(key):
            return f"its capture plan's {key!r} differs (given other recordings, or another fold)"
    return (OOM if manifest.get("complete") is not True else 0), float(job.get("wall_time_s") or 0.0)


def _short(value: Any, limit: int = 120) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def second_pass(mode: str, plan: dict[str, Any]) -> dict[str, Any]:
    """Whether a serial run of ``plan`` takes SECOND_PASS_RULE's second pass under ``--prism-fold-second-pass
    mode``: {"option": mode, "on": bool, "why": the reason, "moe": whether the fold has MoE layers (None: the plan
    does not say)}, said and recorded in the merged trace (``trace.fold.SECOND_PASS_FIELDS``). auto takes it
    for a fold with MoE layers (the plan's ``expert_tokens``, or its layout's ``moe_layers`` > 0: routing follows
    activation values, so the stand-ins' norms steer tokens per expert, hence time and memory), skips it for a
    dense fold (``moe_layers`` 0: they steer values only) and takes it for a plan that does not say; the run
    stops it where a take again routed alike (:func:`_stop_if_routed_alike`)."""
    choices = option(RunOnlyOptions, "fold_second_pass").choices
    if mode not in choices:
        raise ValueError(f"--prism-fold-second-pass must be one of {', '.join(choices)}, got {mode!r}")
    layers = (plan.get("layout") or {}).get("moe_layers")
    moe = True if plan.get("expert_tokens") or layers else (False if layers == 0 else None)
    if mode != "auto":
        return {"option": mode, "on": mode == "on", "why": f"by --prism-fold-second-pass {mode}", "moe": moe}
    if moe is False:
        return {"option": mode, "on": False, "why": "for a dense fold", "moe": moe}
    why = "for a fold with MoE layers" if moe else "where the fold plan does not say whether it has MoE layers"
    return {"option": mode, "on": True, "why": why, "moe": moe}


def capture_plan(plan: dict[str, Any], rank: int, index: int,
                 answers: list[dict[str, Any]] | None = None,
                 p2p_answers: list[dict[str, Any]] | None = None,
                 reduction_answers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The plan of capture ``index`` of a serial run: live rank ``rank`` alone, every rank's rep ``rank``,
    one class (``rank``'s) standing for all; ``capture.part`` keeps the fold's sandbox and each rank's
    class representative (``class_rep``), by which the coordinator tells mirror from self mirror,
    ``answers``: the broadcasts earlier captures recorded (``capture.part.broadcasts`` of their traces), and
    ``p2p_answers``: the norms of the p2p messages they sent to virtual neighbours (``capture.part.p2p_norms``),
    which scale this capture's stand-ins (``nccl_prune.STANDIN_RULE``), and ``reduction_answers``: their live
    ranks' inputs to small reductions over other classes (``capture.part.reductions``), which answer this
    capture's members of those classes (``nccl_prune.RECORDED_REDUCTION_RULE``)."""
    live = [int(x) for x in plan["live"]]
    if rank not in live:
        raise ValueError(f"rank {rank} is not a live rank of the fold (live: {live})")
    world = int(plan["world_size"])
    own = dict(plan["classes"][plan["class_of"][rank]])
    out = {k: v for k, v in plan.items() if k not in ("contributions", "capture")}
    out.update(live=[rank], rep=[rank] * world, class_of=[0] * world,
               classes=[{**own, "count": world, "sandbox": [rank]}],
               capture={"mode": "serial", "rules": dict(SERIAL_RULES),
                        "part": {"rank": rank, "index": index, "of": len(live), "sandbox": live,
                                 "class_rep": [int(x) for x in plan["rep"]], "answers": list(answers or []),
                                 "p2p_answers": list(p2p_answers or []),
                                 "reduction_answers": list(reduction_answers or [])}})
    return out


def captures_dir(trace_dir: Path) -> Path:
    """Where a serial run's captures write their traces: ``TRACE.captures`` beside the merged trace."""
    return trace_dir.with_name(trace_dir.name + ".captures")


def capture_serially(cfg: LaunchConfig, launch: Callable[[LaunchConfig], int],
                     say: Callable[[str], None] = print,
                     second: str = option(RunOnlyOptions, "fold_second_pass").default,
                     resume: bool = False) -> int:
    """Capture ``cfg``'s fold one live rank at a time with ``launch``, then merge the captures at
    ``cfg.trace_dir``; returns the first failing capture's exit code, else OOM where a capture ran out of
    memory under the target's cap (``OOM_CONTINUES_RULE``), else 0. ``second``: ``--prism-fold-second-pass``
    (:func:`second_pass`); ``resume``: ``--prism-fold-resume`` (``RESUME_RULE``). Each capture starts the
    next one's coordinator while it runs (``launcher.coordinator_ahead``)."""
    from prism_megatron.launcher.coordinator_ahead import coordinators_ahead

    with coordinators_ahead():
        return _capture_serially(cfg, launch, say, second, resume)


def _capture_serially(cfg: LaunchConfig, launch: Callable[[LaunchConfig], int], say: Callable[[str], None],
                      second: str, resume: bool) -> int:
    from prism_megatron.trace.merge import merge_captures

    plan = cfg.fold
    if plan is None:
        raise ValueError("a serial capture needs a folded run")
    decided = second_pass(second, plan)
    live = [int(x) for x in plan["live"]]
    root = captures_dir(cfg.trace_dir)
    root.mkdir(parents=True, exist_ok=True)
    code, ooms, captures, walls, answers, iterations = 0, [], [], [], [], {}
    norms: dict[tuple, dict[str, Any]] = {}  # (group, src, dst) -> the latest recording of that p2p stream
    reductions: dict[tuple, dict[str, Any]] = {}  # (group, seq, rank) -> the latest recording of that reduction
    unrecorded: dict[int, int] = {}  # capture index -> its stand-ins given the unit fallback
    unrecorded_reductions: dict[int, int] = {}  # capture index -> its reductions without another class's recording
    failed = 0  # the number (from 1) of the capture that failed
    latest: dict[int, int] = {}  # capture index -> when its latest take ran (0, 1, ...)
    takes = itertools.count()
    taken: dict[int, int] = {}  # capture index -> its takes so far

    def run(i: int, rank: int, again: bool) -> None:
        nonlocal code, failed
        latest[i] = next(takes)
        taken[i] = taken.get(i, 0) + 1
        part = take_dir(root, i, rank, taken[i])
        cls = plan["classes"][plan["class_of"][rank]]["name"]
        head = f"serial capture {i + 1}/{len(live)}{' again' if again else ''}: rank {rank} (class {cls})"
        # no live prediction: one capture's trace is not the job's graph (the merged trace is)
        one = dataclasses.replace(cfg, fold=capture_plan(plan, rank, i, answers, list(norms.values()),
                                                         list(reductions.values())),
                                  trace_dir=part, predictor=None)
        kept = resumable(part, one) if resume and (part / "manifest.json").exists() else None
        if isinstance(kept, tuple):
            code, wall = kept
            say(f"{head}: reused the trace an earlier run of this job left in {part} ({wall:.1f} s then; "
                "--prism-fold-resume)")
            reused.add(i)
        else:
            if kept is not None:
                say(f"{head}: the trace in {part} is not reused: {kept}")
            if again or kept is not None:
                shutil.rmtree(part, ignore_errors=True)
            say(f"{head} is the only process; every other rank is virtual (self mirror, stand-ins); trace {part}")
            t0 = time.perf_counter()
            code = launch(one)
            wall = time.perf_counter() - t0
            reused.discard(i)
        (again_walls if again else walls).append(wall)
        written = (part / "manifest.json").exists()
        reason = None
        if written:
            manifest = json.loads((part / "manifest.json").read_text(encoding="utf-8"))
            reason = manifest.get("incomplete") if manifest.get("complete") is False else None
            got = ((((manifest.get("job") or {}).get("fold") or {}).get("capture") or {}).get("part") or {})
            answers.extend(got.get("broadcasts") or [])
            for e in got.get("p2p_norms") or []:
                norms[(json.dumps(e["group"]), e["src"], e["dst"])] = e
            for e in got.get("reductions") or []:
                reductions[(json.dumps(e["group"]), e["seq"], e["rank"])] = e
            unrecorded[i] = int(got.get("standins_unrecorded") or 0)
            unrecorded_reductions[i] = int(got.get("reductions_unrecorded") or 0)
            iterations[i] = _iterations(part)
        if code != 0 and reason is None:
            reason = f"exited with code {code}"
        if code == OOM and written:  # a prediction (OOM_CONTINUES_RULE): the later captures run
            ooms.append(i)
            code = 0
            more = "; the later captures run" if i + 1 < len(live) and not again else ""
            say(f"serial capture {i + 1}/{len(live)} (rank {rank}, class {cls}) ran out of memory under the "
                f"target's cap: predicted OOM for its class{more}")
        elif code != 0:
            failed = i + 1
            say(f"serial capture {i + 1}/{len(live)} (rank {rank}) failed: {reason}; later captures are not run")
        entry = {"rank": rank, "trace": part if written else None, "incomplete": reason,
                 **({"reused": True} if i in reused else {})}
        if again:
            captures[i] = entry
        else:
            captures.append(entry)

    again_walls: list[float] = []
    reused: set[int] = set()  # the captures whose latest take is an earlier run's (RESUME_RULE)
    for i, rank in enumerate(live):
        if code != 0:
            captures.append({"rank": rank, "trace": None, "incomplete": f"not run: capture {failed} failed first"})
            continue
        run(i, rank, again=False)
    # SECOND_PASS_RULE: a capture whose stand-ins lacked a recording (its senders ran later) is taken again,
    # latest first, once the captures after it have recorded their sends (where --prism-fold-second-pass takes it)
    skipped = []
    for i in reversed(range(len(live))):
        if code != 0:
            break
        if (unrecorded.get(i) or unrecorded_reductions.get(i)) and i not in ooms and any(
                captures[j]["trace"] is not None for j in range(i + 1, len(live))):
            if not decided["on"]:
                skipped.append(i)
                captures[i]["second_pass"] = "skipped"
                continue
            said = [f"{unrecorded[i]} stand-in(s) had neither a recorded norm nor the rank's own scale"] \
                if unrecorded.get(i) else []
            if unrecorded_reductions.get(i):
                said.append(f"{unrecorded_reductions[i]} reduction(s) had no recording of another class's inputs")
            say(f"serial capture {i + 1}/{len(live)}: {' and '.join(said)} (their senders are captured later): "
                "capturing it again with the later captures' recordings (nccl_prune.SECOND_PASS_RULE; second pass "
                f"on {decided['why']})")
            run(i, live[i], again=True)
            captures[i]["second_pass"] = "taken"
            decided = _stop_if_routed_alike(decided, i, live, root, taken, code, say)
    # ... and a capture whose latest take still answered reductions without another class's recording (the
    # classes it lacked were captured before their own second take) once more, first stage first, where a
    # capture of another class was taken after it (skipped where the pass is off or stopped)
    for i in range(len(live)):
        if code != 0:
            break
        if unrecorded_reductions.get(i) and i not in ooms and any(
                latest.get(j, -1) > latest[i] and captures[j]["trace"] is not None for j in range(len(live))):
            if not decided["on"]:
                if captures[i].get("second_pass") is None:
                    skipped.append(i)
                    captures[i]["second_pass"] = "skipped"
                continue
            say(f"serial capture {i + 1}/{len(live)}: {unrecorded_reductions[i]} reduction(s) had no recording of "
                "another class's inputs that the other captures' latest takes made: capturing it again with them "
                f"(nccl_prune.SECOND_PASS_RULE; second pass on {decided['why']})")
            run(i, live[i], again=True)
            captures[i]["second_pass"] = "taken"
            decided = _stop_if_routed_alike(decided, i, live, root, taken, code, say)
    if skipped:
        said = ", ".join(str(i + 1) for i in sorted(skipped))
        say(f"serial capture: capture(s) {said} not captured again: {second_pass_skipped(decided)} "
            "(nccl_prune.SECOND_PASS_RULE)")
    ran = {i: n for i, n in iterations.items() if n}
    for i, n in iterations.items():
        if n == 0 and ran and captures[i]["incomplete"] is None:
            j, m = next(iter(ran.items()))
            captures[i]["incomplete"] = (f"rank {captures[i]['rank']} ran no iteration (capture {j + 1}, rank "
                                         f"{captures[j]['rank']}, ran {m}): its program ended early")
            say(f"serial capture {i + 1}/{len(live)} (rank {captures[i]['rank']}) failed: {captures[i]['incomplete']}")
            code = code or RANK_FAILED
    if any(c["trace"] is not None for c in captures):
        merge_captures(cfg.trace_dir, plan, captures, second_pass=decided)
        say(merged_line(captures, cfg.trace_dir, walls, again_walls))
    return code or (OOM if ooms else 0)


def _stop_if_routed_alike(decided: dict[str, Any], i: int, live: list[int], root: Path, taken: dict[int, int],
                          code: int, say: Callable[[str], None]) -> dict[str, Any]:
    """SECOND_PASS_RULE's stop under auto: where capture ``i``'s latest take routed every token as its take
    before did (``trace.takes``), the second pass's recordings steered no token, so the takes it would still
    add change only values logged: the decision turns off (``unchanged``: the capture that showed it) and the
    rest are skipped, said and recorded. Unchanged otherwise, and under ``--prism-fold-second-pass on``."""
    if decided["option"] != "auto" or not decided["on"] or code != 0 or taken.get(i, 0) < 2:
        return decided
    rank = live[i]
    change = routing_change(take_dir(root, i, rank, taken[i] - 1), take_dir(root, i, rank, taken[i]), rank)
    if change is not None:
        say(f"serial capture {i + 1}/{len(live)}, taken again: {change}; the second pass goes on")
        return decided
    say(f"serial capture {i + 1}/{len(live)}: taken again, it routed every token as its take before did: the "
        "recordings the second pass adds steer no token, so the captures it would still take again are not "
        "(nccl_prune.SECOND_PASS_RULE; --prism-fold-second-pass on takes them)")
    return {**decided, "on": False, "why": f"after capture {i + 1}, taken again, routed every token alike",
            "unchanged": i + 1}


def merged_line(captures: list[dict[str, Any]], trace_dir: Path, walls: list[float],
                again: list[float] = ()) -> str:
    """The line that says what the merged trace holds: how many captures wrote a trace, how many of those
    completed, and each that did not (its reason) or was not run."""
    merged = sum(c["trace"] is not None for c in captures)
    complete = sum(c["trace"] is not None and c["incomplete"] is None for c in captures)
    said = ", ".join(f"{w:.1f}" for w in walls) + (f"; again: {', '.join(f'{w:.1f}' for w in again)}" if again else "")
    bad = [f"capture {i + 1} (rank {c['rank']}) {'incomplete' if c['trace'] is not None else 'not merged'}: "
           f"{c['incomplete'] or 'no trace written'}"
           for i, c in enumerate(captures) if c["trace"] is None or c["incomplete"] is not None]
    reused = [str(i + 1) for i, c in enumerate(captures) if c.get("reused")]
    said += f"; reused from an earlier run: capture(s) {', '.join(reused)}" if reused else ""
    return (f"serial capture: merged {merged} of {len(captures)} capture(s), {complete} complete, into {trace_dir} "
            f"(wall s per capture: {said})" + (f"; {'; '.join(bad)}" if bad else ""))


def _iterations(trace: Path) -> int:
    """The iterations a capture's live rank completed (its "iteration" markers that ended)."""
    from prism_megatron.trace import read_trace

    marks = read_trace(trace).marks
    return sum(1 for n, p in zip(marks.column("name").to_pylist(), marks.column("phase").to_pylist(), strict=True)
               if n == "iteration" and p == "E")
