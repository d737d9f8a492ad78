"""``prism-megatron plan``: the fold of a job (classes, sandbox, virtual ranks), what the sandbox
needs here, roughly how long it takes, and a refusal that says what would fit.

Memory per sandbox rank is prism's own estimate for the rank's class (``memory.estimate``: the
program prism runs, the attention it runs included), and what fits here is judged by it. With a target
GPU (``--prism-target-gpu``) each rank's allocator is capped at the target's usable bytes
(``memory.probe``: ``set_per_process_memory_fraction`` on a GPU, the byte accountant on CPU), so a rank
holds here at most the smaller of its estimate and that cap: a class whose estimate exceeds the cap is a
predicted OOM that the run reaches at the cap (recording the failing allocation), not a sandbox that
cannot run; where the cap itself is above what a device holds, such a rank could exhaust the device first,
and the plan refuses it. Megatron's
theoretical formula for the most loaded shard (``megatron.training.theoretical_memory_usage``) is
shown beside it, not used: it misses the unfused attention's s x s probabilities and counts
sequence-parallel activations unsharded. The time is a stated rough model, not a prediction.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

from prism_megatron.megatron.fold import (
    EXPERT_TOKENS,
    FoldDepthError,
    FoldPlan,
    TargetLayout,
    build_fold_plan,
    import_megatron,
    layout_from_args,
    resolve_depth,
)
from prism_megatron.megatron.megatron_args import ESTIMATE_KEY, ask_megatron_args, padded_vocab, parse_megatron_args

__all__ = ["PLAN_JSON_VERSION", "PlanError", "Plan", "start_planning", "make_plan", "plan_json", "render_plan",
           "plan_fits", "plan_verdict", "predicted_ooms", "one_rank_fits", "serial_refusal", "SERIAL_MOE_DISPATCHERS",
           "ROUGH_TIME_MODEL", "REPORT_TIME_MODEL", "SERIAL_GPU_TIME_MODEL", "second_pass_bound"]

# 2: microbatches (the micro-batch fold's record, or null); 3: memory by prism's estimate; 4: capture;
# 5: the target's cap (memory.target, memory.per_rank_held), verdict and predicted_oom; 6: no capture.stops_at,
# capture.not_captured (a serial run captures every class past a predicted OOM)
# 7: capture.second_pass (serial: at_most, the captures SECOND_PASS_RULE may add; counted, those in time.seconds),
# time.captures
# 8: memory.swap_host (swaps: what a switch holds in host memory against the budget, runtime.hostplan)
# 9: time.report_s, time.report_ops (the report step after the captures, counted in time.seconds)
# 10: serial: time.captures_s (each capture's expected seconds, in order, the takes again last) and time.run_s
# (the run's own cost besides them); capture.second_pass.counted is the takes again expected (auto: its stop),
# at_most their bound; time.report_s is 0 where a class is predicted to run out of memory (no replay)
# 11: said (the lines the plan says before its table: the options a recipe chose, the micro-batch fold)
PLAN_JSON_VERSION = 11
# per class (memory.classes, memory.per_rank: the most of a live rank), Megatron's formula under memory.megatron
GiB = 1 << 30
#: Host memory of one live rank's process besides its GPU state (Python, torch, Megatron, the
#: runtime's buffers); rough, and on CPU devices added to the rank's state.
RANK_PROCESS_HOST_BYTES = 1 * GiB
#: Share of the available host RAM the plan lets the sandbox take (the launcher's swap default too).
HOST_SHARE = 0.9
#: The rough time model: start-up, then each iteration's model FLOPs of the sandbox at a sustained rate.
ROUGH_TIME_MODEL = {
    "startup_s": 5.0,  # template, Megatron import and set-up
    "startup_per_rank_s": 0.5,  # each rank's initialisation and group creation, serialised
    "cpu_flops_per_core": 20e9,  # fp32 torch matmuls on one core, sustained
    "gpu_flops": 150e12,  # one H200-class GPU on small emulated shapes, sustained
    "overhead_per_rank_iteration_s": 0.1,  # coordinator turns and slot switches per rank and iteration
}
#: Serial captures on a GPU: the run's own cost (interpreters, planning, the merge), then per capture its own
#: cost (its coordinator and rank starting, Megatron's set-up, the model's build, the exit) and its live rank's
#: iterations at a sustained model FLOP/s (a MoE rank runs the local spec's SequentialMLP, host-bound); a capture
#: predicted to run out of memory under the target's cap ends in its first iterations. Each constant is read off
#: the target recipes' runs on one H200 by bench/targets/capture_time_model.py (docs/measurements.md).
SERIAL_GPU_TIME_MODEL = {
    "run_s": 49.0,
    "capture_s": 17.4,
    "dense_flops": 218e12,
    "moe_flops": 67e12,
    "oom_iterations": 0.17,  # the median: most run out in iteration 1, before its first step's optimizer state
}
#: The second pass's takes again the plan expects under auto, which stops at the first take that routed every
#: token as its take before did (launcher.serial); --prism-fold-second-pass on counts its bound.
SECOND_PASS_EXPECTED_TAKES = 1
#: The report step after the captures: the replay walks every op of the target's micro-batches on the ranks it
#: replays, then the report and its timeline are written; its time goes with that op count. Ops per layer and
#: micro-batch on one rank (forward and backward) by sublayer kind and whether TP > 1 (with sequence parallelism;
#: shared experts add a TP-split MLP's), and the step's seconds per op, counted in the target recipes' shrunk
#: traces by bench/targets/report_step_model.py (docs/measurements.md).
REPORT_TIME_MODEL = {
    "s_per_op": 50e-6,
    "attention_ops": {("mha", False): 0.25, ("mha", True): 6.0, ("mla", False): 0.25, ("mla", True): 19.0},
    "mlp_ops": {("dense", False): 0.25, ("dense", True): 6.0, ("moe", False): 7.5, ("moe", True): 8.5},
}


class PlanError(ValueError):
    """A plan that cannot run here; the message says what would."""


@dataclass
class Plan:
    layout: TargetLayout
    fold: FoldPlan
    iterations: int | None
    devices: list[str]
    memory: dict[str, Any] = field(default_factory=dict)
    time: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    depth_note: str = ""  # why the fold has its depth (fold.resolve_depth)
    #: how the sandbox is captured: {"mode": "together"}, or serial with its captures and fit
    capture: dict[str, Any] = field(default_factory=lambda: {"mode": "together"})


def _host_available() -> int:
    from prism_megatron.runtime.hostplan import available_host_memory

    return available_host_memory()


def _gpu_totals(devices: list[str]) -> list[int]:
    """Each device's total memory; a device this machine lacks is refused with how to plan for it from here."""
    from prism_megatron.launcher.config import LaunchError, _check_gpus

    try:
        return _check_gpus(devices)
    except LaunchError as e:
        raise LaunchError(f"{e}; to plan for a machine that has them, give its device memory "
                          "(--prism-device-memory GiB, and --prism-host-memory GiB)") from None


def _prism_estimate(args: Any, world_size: int, fold: FoldPlan, devices: list[str],
                    env: dict[str, str] | None) -> dict[str, Any]:
    """Prism's estimate per class of ``fold`` (``memory.estimate``) for the program the ranks run here
    (the device kind, ``--prism-attention``, ``--prism-optimizer``), or why there is none."""
    from prism_megatron.memory.estimate import ESTIMATE_SOURCE, EstimateError, estimate_classes, job_from_args
    from prism_megatron.patches.attention import ENV_VAR as ATTENTION_ENV
    from prism_megatron.patches.fused_optimizer import ENV_VAR as OPTIMIZER_ENV
    from prism_megatron.patches.fused_optimizer import fused_adam_importable

    vocab = padded_vocab(args)
    if vocab is None:
        return {"error": "the padded vocabulary is known only once the tokenizer is built (not a NullTokenizer)"}
    sdpa = (env or {}).get(ATTENTION_ENV) == "sdpa" or getattr(args, "prism_attention", None) == "sdpa"
    try:
        job = job_from_args(args, world_size, vocab, "cpu" if devices == ["cpu"] else "cuda", "sdpa" if sdpa else None,
                            fused_step=(env or {}).get(OPTIMIZER_ENV) == "fused" or fused_adam_importable())
        return {"source": ESTIMATE_SOURCE, "device": job.device, "attention": job.attention,
                "fused_step": job.fused_step, "classes": estimate_classes(job, fold)}
    except EstimateError as e:
        return {"error": str(e)}


def _megatron_column(estimate: dict[str, Any]) -> dict[str, Any]:
    """Megatron's formula as the plan shows it beside prism's estimate (not used to judge the fit)."""
    return {key: estimate.get(key) for key in ("total", "weight_and_optimizer", "activation", "source", "error")}


def _target_json(target: Any) -> dict[str, Any] | None:
    """``target`` (a ``memory.targets.TargetGPU`` or its ``as_dict()``) as the plan records it, or None."""
    if target is None:
        return None
    t = target.as_dict() if hasattr(target, "as_dict") else dict(target)
    return {"gpu": t["name"], "cap": int(t["usable"]), "source": t.get("source")}


def _memory(fold: FoldPlan, estimate: dict[str, Any], devices: list[str], device_gib: float | None,
            host_gib: float | None, swap: str, megatron: dict[str, Any] | None = None,
            target: Any = None) -> dict[str, Any]:
    """What the sandbox needs against what is here, by prism's estimate per class (``estimate['classes']``,
    ``_prism_estimate``); ``fits`` None when there is none. ``megatron``: Megatron's formula, shown beside.
    ``target``: the target GPU (``TargetGPU`` or its dict), whose cap bounds what a rank holds here."""
    n = len(fold.live)
    host = int(host_gib * GiB) if host_gib is not None else int(_host_available() * HOST_SHARE)
    out: dict[str, Any] = {"sandbox_ranks": n, "host_available": host, "source": estimate.get("source"),
                           "host_per_rank_process": RANK_PROCESS_HOST_BYTES,
                           "megatron": _megatron_column(megatron or {"error": "not computed"})}
    classes = estimate.get("classes")
    if not classes:
        out.update(per_rank=None, classes=None, fits=None,
                   why=f"prism's memory estimate is unavailable: {estimate.get('error')}")
        return out
    out["classes"] = classes
    need = {r: classes[fold.class_name(r)]["total"] for r in fold.live}
    heaviest = max(fold.live, key=lambda r: need[r])
    heavy_class = fold.class_name(heaviest)
    out["per_rank"] = need[heaviest]
    out["per_rank_class"] = heavy_class
    cap = None
    if (tj := _target_json(target)) is not None:
        # the allocator stops a rank at the cap (memory.probe): what it holds here is bounded by it
        cap = tj["cap"]
        out["target"] = {**tj, "oom": {name: c["total"] for name, c in classes.items() if c["total"] > cap}}
    held = {r: need[r] if cap is None else min(need[r], cap) for r in fold.live}
    per_rank, state = held[heaviest], sum(held.values())
    out["per_rank_held"] = per_rank
    on_cpu = devices == ["cpu"]
    if on_cpu:
        need_host = state + n * RANK_PROCESS_HOST_BYTES
        out.update(gpu_needed=0, host_needed=need_host, devices_total=0, fits=need_host <= host)
        if not out["fits"]:
            out["why"] = (f"the sandbox's {n} ranks need {need_host / GiB:.1f} GiB of host RAM (prism's estimate "
                          f"{state / GiB:.2f} GiB + {RANK_PROCESS_HOST_BYTES / GiB:.0f} GiB process each); "
                          f"{host / GiB:.1f} GiB may be used here: run on GPUs (--prism-devices) or on a machine "
                          f"with at least {need_host / HOST_SHARE / GiB:.0f} GiB available")
        return out
    per_device = int(device_gib * GiB) if device_gib is not None else min(_gpu_totals(devices))
    gpu_need = state
    gpu_have = per_device * len(devices)
    spill = max(0, gpu_need - gpu_have)
    swap_room = host - n * RANK_PROCESS_HOST_BYTES if swap != "none" else 0
    need_host = n * RANK_PROCESS_HOST_BYTES + spill
    fits = per_rank <= per_device and spill <= max(0, swap_room)
    out.update(gpu_needed=gpu_need, devices_total=gpu_have, per_device=per_device, host_needed=need_host, fits=fits)
    if swap != "none" and spill > 0:  # swaps: what a switch holds in host memory (runtime.hostplan)
        from prism_megatron.launcher.config import IN_PROCESS_SWAPPERS, block_of, swapper_for
        from prism_megatron.runtime.hostplan import swap_host_need

        live = sorted(fold.live)  # on devices as the launcher places them (LaunchConfig.device_of)
        sizes = [[held[r] for i, r in enumerate(live) if block_of(i, len(live), len(devices)) == d] or [0]
                 for d in range(len(devices))]
        host_fits, out["swap_host"] = swap_host_need(sizes, per_device, max(0, swap_room),
                                                     whole_state=swapper_for(swap, True) not in IN_PROCESS_SWAPPERS,
                                                     basis="prism's memory estimates")
        if not host_fits and per_rank <= per_device:
            out.update(fits=False, why=out["swap_host"])
    if per_rank > per_device:
        if cap is not None and need[heaviest] > cap:  # over the cap, and the cap is over the device
            out["why"] = (f"a sandbox rank of class {heavy_class} needs {need[heaviest] / GiB:.1f} GiB (prism's "
                          f"estimate), more than the target {tj['gpu']}'s cap of {cap / GiB:.1f} GiB per rank, but "
                          f"that cap is above the {per_device / GiB:.1f} GiB a device holds here: the rank could "
                          "exhaust the device before its cap stops it, so its OOM would be the emulation's, not "
                          f"the target's: use GPUs with more than {cap / GiB:.1f} GiB")
        else:
            out["why"] = (f"a sandbox rank of class {heavy_class} needs {per_rank / GiB:.1f} GiB (prism's "
                          f"estimate) but a device holds {per_device / GiB:.1f} GiB: use GPUs with at least that "
                          "much memory (or a layout with smaller shards: more TP/PP, recompute, "
                          "--prism-attention sdpa)")
    elif not fits:
        devices_needed = math.ceil(max(0, gpu_need - max(0, swap_room)) / per_device)
        out["why"] = (f"the sandbox's {n} ranks need {gpu_need / GiB:.1f} GiB of GPU memory; {len(devices)} device(s) "
                      f"hold {gpu_have / GiB:.1f} GiB and host RAM {max(0, swap_room) / GiB:.1f} GiB more"
                      f"{'' if swap != 'none' else ' (swap is off)'}: use at least {devices_needed} device(s) of "
                      f"{per_device / GiB:.0f} GiB (--prism-devices)")
    return out


def _time(fold: FoldPlan, args: Any, vocab: int | None, iterations: int | None, devices: list[str]) -> dict[str, Any]:
    """Rough emulation time: start-up plus each iteration's sandbox FLOPs at an assumed sustained rate."""
    from prism_megatron.megatron.workload import flops_per_iteration

    m = ROUGH_TIME_MODEL
    n = len(fold.live)
    iters = iterations or 1
    try:
        flops = flops_per_iteration(args, vocab) * n / fold.world_size if vocab else None
    except (AttributeError, TypeError, ZeroDivisionError):
        flops = None
    if devices == ["cpu"]:
        from prism_megatron.launcher.config import cores

        n_cores = cores()
        rate, where = m["cpu_flops_per_core"] * n_cores, f"{n_cores} CPU core(s)"
    else:
        rate, where = m["gpu_flops"] * len(devices), f"{len(devices)} GPU(s)"
    compute = (flops or 0.0) / rate
    per_iter = compute + m["overhead_per_rank_iteration_s"] * n
    total = m["startup_s"] + m["startup_per_rank_s"] * n + iters * per_iter
    return {"seconds": total, "per_iteration_s": per_iter, "iterations": iters, "sandbox_flops_per_iteration": flops,
            "model": (f"rough: {m['startup_s']:.0f} s + {m['startup_per_rank_s']} s per rank to start, then per "
                      f"iteration the sandbox's model FLOPs at {rate / 1e12:.2f} TFLOP/s on {where} + "
                      f"{m['overhead_per_rank_iteration_s']} s per rank; easily off by 3x")}


def _report_time(time: dict[str, Any], t: TargetLayout, fold: FoldPlan, args: Any,
                 microbatches: dict | None, oom: bool = False) -> dict[str, Any]:
    """``time`` with the report step added: the ops the replay walks (the target's micro-batches on every rank
    it replays: one pipeline, or the live ranks, for a fold; every rank otherwise) at the model's seconds per op.
    ``oom``: a class is predicted to run out of memory, so the report replays nothing (no time prediction)."""
    from prism_megatron.megatron.fold import _moe_pattern

    if oom:
        return {**time, "report_s": 0.0, "report_ops": 0,
                "model": time["model"] + "; then the report, which replays nothing where a class runs out of memory"}
    m = REPORT_TIME_MODEL
    target = (microbatches or {}).get("target")
    count = int(target) if target else int(args.global_batch_size) // (int(args.micro_batch_size) * t.dp)
    split = t.tp > 1
    attention = m["attention_ops"][("mla" if getattr(args, "multi_latent_attention", False) else "mha", split)]
    shared = m["mlp_ops"][("dense", split)] if getattr(args, "moe_shared_expert_intermediate_size", None) else 0.0
    per_microbatch = sum(attention + (m["mlp_ops"][("moe", split)] + shared if moe else m["mlp_ops"][("dense", split)])
                         for moe in _moe_pattern(t))  # every layer of the model: one pipeline
    replayed = max(len(fold.live), t.pp)  # an unfolded run's live ranks are every rank
    ops = time["iterations"] * count * per_microbatch * replayed / t.pp
    seconds = ops * m["s_per_op"]
    return {**time, "seconds": time["seconds"] + seconds, "report_s": seconds, "report_ops": round(ops),
            "model": time["model"] + f"; then the report: ~{ops / 1e6:.2g} M ops replayed at "
                                     f"{m['s_per_op'] * 1e6:.0f} us each ({count} micro-batches)"}


def one_rank_fits(plan: Plan) -> tuple[bool | None, str]:
    """Whether the sandbox's most loaded rank alone fits here (a serial capture runs one live rank at a
    time): its state (prism's estimate for its class) within one device, or on CPU with its process within
    the host RAM prism may use; None without prism's estimate."""
    m = plan.memory
    per_rank = m.get("per_rank")
    if per_rank is None:
        return None, f"prism's memory estimate is unavailable ({m.get('why')})"
    held = m.get("per_rank_held", per_rank)  # bounded by the target's cap, where there is one
    if plan.devices == ["cpu"]:
        need, have, where = held + RANK_PROCESS_HOST_BYTES, m["host_available"], "of host RAM"
    else:
        need, have, where = held, m["per_device"], "of one device"
    capped = (f" (class {m.get('per_rank_class')}: estimate {per_rank / GiB:.1f} GiB, stopped at the target's cap)"
              if held < per_rank else "")
    return need <= have, f"one live rank needs {need / GiB:.1f} GiB{capped} against {have / GiB:.1f} GiB {where}"


#: Token dispatchers whose expert all-to-alls a serial capture answers as the capture together does (the
#: translated mirror at class depth: their exchanges stay inside one stage's class, ``serial_refusal``)
SERIAL_MOE_DISPATCHERS = ("alltoall", "allgather")


def serial_refusal(layout: TargetLayout, depth: str, args: Any = None) -> str | None:
    """Why a serial capture of this layout at fold ``depth`` is not answered by a defended rule, or None.

    A serial capture changes only what reaches the live rank from virtual members of *another* class
    (self mirror, stand-ins, recorded broadcasts: launcher.serial). At class depth every expert-parallel
    peer of a live MoE rank is of its own class (the same stage), so its token-count gather and token
    all-to-alls are answered as captured together (the translated mirror); what crosses classes is what
    crosses them for a dense layout (pipeline p2p, embedding and model-parallel reductions) plus the
    expert tensor-model-pipeline group's grad-norm and inf/NaN reductions, which self mirror answers as it
    does the dense model-parallel group's. Refused: replica depth (each expert rank is its own class, live
    in another capture: its all-to-all pieces and counts would be self mirrored, untranslated), a
    dispatcher outside ``SERIAL_MOE_DISPATCHERS``, and ``--calculate-per-token-loss`` with PP > 1 (every
    stage scales its gradients by the last stage's token count, broadcast over the pipeline group from a
    stage captured after the first)."""
    if args is not None and getattr(args, "calculate_per_token_loss", False) and layout.pp > 1:
        return ("--calculate-per-token-loss: every stage divides its gradients by the token count the last stage "
                "broadcasts over the pipeline group, an integer a first stage captured before the last cannot be "
                "answered with; capture together (--prism-fold-capture together)")
    if not layout.num_experts:
        return None
    dispatcher = getattr(args, "moe_token_dispatcher_type", None) if args is not None else None
    if dispatcher is not None and dispatcher not in SERIAL_MOE_DISPATCHERS:
        return (f"--moe-token-dispatcher-type {dispatcher}: a serial capture answers the "
                f"{' and '.join(SERIAL_MOE_DISPATCHERS)} dispatchers' expert exchanges only (its kernels bypass the "
                "groups prism folds); capture together, or render the recipe with alltoall")
    if depth != "class" and layout.ep > 1:
        return (f"a MoE layout (EP{layout.ep}) at {depth} depth: each expert rank is a class of its own, live in "
                "another capture, so its token counts and all-to-all pieces would be answered by self mirror of one "
                "rank's untranslated routing; a serial capture folds expert peers at class depth "
                "(--prism-fold-depth class: each capture's expert all-to-alls answered by the translated mirror, as "
                "captured together)")
    return None


def _serial(plan: Plan, args: Any = None) -> dict[str, Any]:
    """The serial capture's entry of a plan: its captures, and whether one live rank at a time fits
    (``refused``: a layout no rule answers, ``serial_refusal``)."""
    n = len(plan.fold.live)
    refused = serial_refusal(plan.layout, plan.fold.depth, args)
    if refused is not None:
        if plan.memory.get("fits"):
            refused += "; the sandbox fits here together (--prism-fold-capture together)"
        return {"mode": "serial", "captures": n, "fits": False, "refused": True, "why": refused}
    fits, why = one_rank_fits(plan)
    if plan.fold.expert_tokens:
        why += (f"; expert peers answered by the {plan.fold.expert_tokens} of each capture's live rank, as captured "
                "together")
    return {"mode": "serial", "captures": n, "fits": fits, "why": why}


def plan_fits(plan: Plan) -> bool | None:
    """Whether the sandbox runs here: together, or one live rank at a time under serial capture (True
    also where it runs to a predicted OOM at the target's cap: ``plan_verdict``)."""
    return plan.capture.get("fits") if plan.capture["mode"] == "serial" else plan.memory.get("fits")


def predicted_ooms(plan: Plan) -> list[str]:
    """One line per rank class whose estimate exceeds the target's cap, for a sandbox that runs here
    (``plan_fits``): the run stops such a rank at the cap and records the failing allocation."""
    target = plan.memory.get("target") or {}
    if not target.get("oom") or not plan_fits(plan):
        return []
    cap = target["cap"]
    lines = [f"rank class {name}: predicted OOM on {target['gpu']} (estimate {total / GiB:.1f} GiB > cap "
             f"{cap / GiB:.1f} GiB); the run stops it at the cap and reports the failing allocation"
             for name, total in target["oom"].items()]
    c = plan.capture
    if c["mode"] == "serial":  # launcher.serial.OOM_CONTINUES_RULE
        order = [plan.fold.class_name(r) for r in plan.fold.live]
        over = [name for name in order if name in target["oom"]]
        lines.append(f"serial: every class is captured; a capture that reaches its OOM ({', '.join(over)}) ends "
                     "there and the later captures still run, so the report gives each class its verdict (fits, or "
                     "the failing allocation) and no time prediction")
    elif c["mode"] == "together":
        lines.append("together: the run ends at the first rank that reaches its cap")
    return lines


def plan_verdict(plan: Plan) -> str:
    """The plan's verdict in words: runs, runs (to an OOM verdict), does not fit, refused, not checked."""
    if plan.capture.get("refused"):
        return "refused"
    fits = plan_fits(plan)
    if fits is None:
        return "not checked"
    if not fits:
        return "does not fit"
    return "runs (to an OOM verdict)" if predicted_ooms(plan) else "runs"


def _auto_serial_moe(layout: TargetLayout, fold: FoldPlan, memory: dict[str, Any], args: Any, world_size: int,
                     devices: list[str], env: dict[str, str] | None,
                     device_gib: float | None, host_gib: float | None, swap: str, megatron: dict[str, Any],
                     note: str, target: Any = None) -> tuple[str, str, FoldPlan, dict[str, Any]]:
    """``--prism-fold-depth auto`` for a MoE layout captured serially: its replica where the replica fits
    here together (every expert rank keeps its own routing; a MoE replica is captured together), else class
    depth, the one a serial capture answers (``serial_refusal``). (depth, why, fold, memory)."""
    if memory.get("fits") is not False:
        why = ("one model replica fits here together" if memory.get("fits") else
               "prism's memory estimate is unavailable to say that class depth is needed")
        return "replica", (f"auto: replica for a MoE layout ({why}; its expert ranks keep their own routing: capture "
                           "it together, a serial capture folds expert peers at class depth)"), fold, memory
    try:
        deep = build_fold_plan(layout, "class")
    except FoldDepthError as e:
        return "replica", f"{note}; class depth, which a serial capture needs, is refused: {e}", fold, memory
    deep_estimate = _prism_estimate(args, world_size, deep, list(devices), env)
    deep_memory = _memory(deep, deep_estimate, list(devices), device_gib, host_gib, swap, megatron, target)
    return "class", (f"auto: class for a MoE layout captured serially (one model replica does not fit here: "
                     f"{memory.get('why')}; a serial capture answers expert peers at class depth by the "
                     f"{EXPERT_TOKENS} of each capture's live rank)"), deep, deep_memory


def start_planning(script: Any, script_args: list[str], world_size: int, env: dict[str, str] | None = None,
                   fold: bool = True, gpus: bool = False) -> None:
    """Start the slow parts of planning ``script script_args`` side by side: Megatron's parse of the command,
    asked of the parsing child (which imports Megatron), the list of this machine's GPUs where the plan will ask
    for their memory (``gpus``; a child that imports torch and starts CUDA), and, for a fold (``fold``), the
    Megatron modules the fold plan reads, imported here meanwhile (seconds each); the plans then find them done.
    A failure is left to the step that needs it, which says it as before."""
    ask_megatron_args(script, list(script_args), world_size, env)
    if gpus:
        from prism_megatron.launcher.config import start_gpu_query

        start_gpu_query()
    if fold:
        with contextlib.suppress(ImportError):
            import_megatron()


def make_plan(script: Any, script_args: list[str], world_size: int, devices: list[str], gpus_per_node: int = 8,
              device_gib: float | None = None, host_gib: float | None = None, swap: str = "auto",
              env: dict[str, str] | None = None, source: str = "", fold_depth: str = "auto",
              capture: str = "together", target: Any = None, second_pass: str = "auto",
              microbatches: dict | None = None) -> Plan:
    """Parse the command with Megatron's parser, fold it (``fold_depth``: auto, replica or class), and
    cost the sandbox here, captured ``capture`` (together, or serial: one live rank at a time).
    ``target``: the target GPU (``memory.targets.TargetGPU`` or its ``as_dict()``) whose cap each rank's
    allocator runs under, or None (no cap). ``second_pass``: ``--prism-fold-second-pass`` (serial captures: the
    captures taken again count in the expected time). ``microbatches``: the micro-batch fold's record for the
    command (``choose_microbatches``), whose target count the report step replays."""
    args = parse_megatron_args(script, script_args, world_size, env)
    layout = layout_from_args(args, world_size, gpus_per_node)
    depth, depth_note = resolve_depth(layout, fold_depth)
    megatron = getattr(args, ESTIMATE_KEY, None) or {"error": "not computed"}
    fold = build_fold_plan(layout, depth)
    estimate = _prism_estimate(args, world_size, fold, list(devices), env)  # per class: the same at any depth
    memory = _memory(fold, estimate, list(devices), device_gib, host_gib, swap, megatron, target)
    if fold_depth == "auto" and depth == "replica" and capture == "serial" and layout.num_experts and layout.ep > 1:
        depth, depth_note, fold, memory = _auto_serial_moe(layout, fold, memory, args, world_size, devices,
                                                           env, device_gib, host_gib, swap, megatron, depth_note,
                                                           target)
    if fold_depth == "auto" and depth == "class" and not fold.expert_tokens:
        # Fold no deeper than needed: a replica keeps every TP/CP partial and every stage real (values
        # and schedules exact), while class depth stands in for them; take class only when a replica
        # does not fit here.
        replica = build_fold_plan(layout, "replica")
        replica_memory = _memory(replica, estimate, list(devices), device_gib, host_gib, swap, megatron, target)
        if replica_memory.get("fits") is not False:
            fold, memory = replica, replica_memory
            depth_note = ("auto: replica (one model replica fits here; class depth, which stands in for TP/CP "
                          "peers' partial sums and middle stages, is taken only when it does not)"
                          if replica_memory.get("fits") else
                          "auto: replica (prism's memory estimate is unavailable to say that class depth is needed)")
        else:
            depth_note = f"auto: class (one model replica does not fit here: {replica_memory.get('why')})"
    iterations = getattr(args, "train_iters", None)
    plan = Plan(layout=layout, fold=fold, iterations=iterations, devices=list(devices), source=source,
                depth_note=depth_note)
    plan.memory = memory
    plan.time = _time(fold, args, megatron.get("vocab") or padded_vocab(args), iterations, plan.devices)
    ooms = set((memory.get("target") or {}).get("oom") or {})
    if capture == "serial":
        plan.capture = _serial(plan, args)
        plan.capture["second_pass"] = _second_pass(fold, second_pass, ooms)
        plan.time = _serial_time(plan.time, fold, plan.capture["second_pass"], bool(layout.num_experts), ooms,
                                 plan.devices != ["cpu"])
    plan.time = _report_time(plan.time, layout, fold, args, microbatches, bool(ooms and plan_fits(plan)))
    return plan


def second_pass_bound(fold: FoldPlan) -> int:
    """How many captures SECOND_PASS_RULE may add to a serial run of ``fold``'s k live ranks: at most k-1 taken
    again latest first (every capture but the last: pipeline stand-ins sent by later captures, reductions over
    another class's members) and k-1 once more first stage first (reductions whose recordings the first sweep
    made later): 2(k-1). The launcher decides from what each capture recorded; the plan can only bound it.
    Megatron's grad-norm reduction spans every live rank's class, so any k > 1 may need them."""
    return 2 * (len(fold.live) - 1)


def _second_pass(fold: FoldPlan, mode: str, oom_classes: set[str]) -> dict[str, Any]:
    """The plan's foresight of SECOND_PASS_RULE: the captures it may add and whether ``mode`` takes them (the
    serial launcher's own decision, ``launcher.serial.second_pass``); ``counted``: the takes again expected, only
    of a capture before the last that runs to its end (one that runs out of memory is never taken again), under
    auto at most ``SECOND_PASS_EXPECTED_TAKES`` (its stop)."""
    from prism_megatron.launcher.serial import second_pass

    decided = second_pass(mode, fold.to_json())
    bound = second_pass_bound(fold)
    names = [fold.class_name(r) for r in fold.live]
    if not decided["on"] or not any(name not in oom_classes for name in names[:-1]):
        counted = 0
    else:
        counted = bound if mode == "on" else min(bound, SECOND_PASS_EXPECTED_TAKES)
    return {"option": mode, "on": decided["on"], "why": decided["why"], "at_most": bound, "counted": counted}


def _serial_time(time: dict[str, Any], fold: FoldPlan, second: dict[str, Any], moe: bool,
                 oom_classes: set[str], on_gpu: bool) -> dict[str, Any]:
    """Serial captures start a job each, one after another, each running its live rank's share of the
    iterations (a class predicted to run out of memory ends in its first: ``oom_iterations``); the takes again
    the second pass is expected to add repeat a capture that runs to its end. On a GPU the constants are
    ``SERIAL_GPU_TIME_MODEL``'s, on CPU the rough model's (with the GPU's fraction of an iteration before an OOM)."""
    n = len(fold.live)
    iters = time["iterations"]
    flops = (time["sandbox_flops_per_iteration"] or 0.0) / n
    names = [fold.class_name(r) for r in fold.live]
    if on_gpu:
        g = SERIAL_GPU_TIME_MODEL
        rate = g["moe_flops"] if moe else g["dense_flops"]
        run_s, start, per_iter = g["run_s"], g["capture_s"], flops / rate
        said = (f"serial on a GPU: {run_s:.0f} s a run + {start:.0f} s a capture, then each live rank's model FLOPs "
                f"at {rate / 1e12:.0f} TFLOP/s ({'MoE' if moe else 'dense'}, fitted to the target recipes' runs on "
                f"one H200); {n} capture(s) one after another")
    else:
        m = ROUGH_TIME_MODEL
        run_s, start, per_iter = 0.0, m["startup_s"] + m["startup_per_rank_s"], time["per_iteration_s"] / n
        said = time["model"] + f"; serial: {n} jobs started one after another"
    oom_iters = SERIAL_GPU_TIME_MODEL["oom_iterations"]
    captures = [start + (oom_iters if name in oom_classes else iters) * per_iter for name in names]
    again = second["counted"]
    if again:
        said += f", {again} more expected for the second pass ({second['why']}; at most {second['at_most']})"
    elif second["at_most"]:
        said += f" (second pass off {second['why']})" if not second["on"] else " (no capture to take again)"
    if oom_classes:
        said += (f"; class(es) {', '.join(sorted(oom_classes))} predicted to run out of memory, each capture ending "
                 "in its first iterations")
    captures += [start + iters * per_iter] * again
    return {**time, "seconds": run_s + sum(captures), "run_s": run_s, "captures_s": [round(c, 1) for c in captures],
            "captures": n + again, "model": said}


def plan_json(plan: Plan, microbatches: dict | None = None, said: list[str] | None = None) -> dict[str, Any]:
    """The plan for programs (``plan --json``); ``fold`` is ``FoldPlan.to_json()``, ``microbatches`` the
    trace's ``job.microbatches`` record the run would write (None: every micro-batch runs), ``said`` the lines the
    plan says before its table (which options a recipe chose: the plan is of them)."""
    return {"version": PLAN_JSON_VERSION, "said": list(said or []), "source": plan.source,
            "layout": plan.layout.describe(),
            "devices": plan.devices, "iterations": plan.iterations, "memory": plan.memory, "time": plan.time,
            "fold_depth": plan.depth_note, "fold": plan.fold.to_json(), "microbatches": microbatches,
            "capture": plan.capture, "fits": plan_fits(plan), "verdict": plan_verdict(plan),
            "predicted_oom": predicted_ooms(plan)}


def _ranks(ranks: list[int], limit: int = 12) -> str:
    from prism_megatron.report.units import rank_ranges

    text = rank_ranges(ranks)
    return text if len(text) <= 60 else f"{', '.join(map(str, ranks[:limit]))}, … ({len(ranks)} ranks)"


def _gib(n: int | None) -> str:
    from prism_megatron.report.units import fmt_bytes

    return "unknown" if n is None else fmt_bytes(n)


def _class_total(classes: dict[str, Any], name: str) -> int | None:
    """A class row's estimate; a merged row of expert classes ('first/ep*') shows its largest."""
    if name in classes:
        return classes[name]["total"]
    stage = name.partition("/")[0]
    found = [c["total"] for n, c in classes.items() if n.partition("/")[0] == stage]
    return max(found) if found else None


#: Beyond this many classes, a stage's expert-rank classes share one row.
CLASS_ROWS_LIMIT = 24


def _class_rows(fold: FoldPlan) -> list[tuple[str, str, int, list[int]]]:
    """(name, role, ranks, sandbox) per class, or per stage group when expert ranks make too many rows."""
    rows = [(c.name, c.role, c.count, c.sandbox) for c in fold.classes]
    if len(rows) <= CLASS_ROWS_LIMIT:
        return rows
    merged: dict[str, list] = {}
    for c in fold.classes:
        stage, _, _ = c.name.partition("/")
        row = merged.setdefault(stage, [f"{stage}/ep*", c.role.rpartition(", expert rank")[0], 0, [], 0])
        row[2] += c.count
        row[3] += c.sandbox
        row[4] += 1
    return [(name, f"{role}; {n} expert ranks, one class each", count, sorted(sandbox))
            for name, role, count, sandbox, n in merged.values()]


def render_plan(plan: Plan, console: Any) -> None:
    """The plan as rich tables: classes, sandbox and virtual ranks, memory here, rough time."""
    from rich.table import Table

    f, m, t = plan.fold, plan.memory, plan.time
    console.print(f"[bold]plan[/bold] {plan.source}: {plan.layout.describe()} "
                  f"({plan.layout.gpus_per_node} GPUs per node)")
    console.print(f"fold depth: {f.depth} ({plan.depth_note})" if plan.depth_note else f"fold depth: {f.depth}")
    classes = m.get("classes") or {}
    formula = (m.get("megatron") or {}).get("total")
    table = Table(title="rank classes (memory per rank: prism's estimate of what it runs here; 'Megatron': its "
                        "formula for the most loaded shard, shown, not used)")
    for col in ("class", "role", "ranks", "sandbox (live)", "per rank", "Megatron", "live memory"):
        table.add_column(col, justify="right" if col in ("ranks", "per rank", "Megatron", "live memory") else "left")
    for name, role, count, sandbox in _class_rows(f):
        each = _class_total(classes, name)
        table.add_row(name, role, f"{count:,}", _ranks(sandbox), _gib(each), _gib(formula),
                      _gib(None if each is None else each * len(sandbox)))
    console.print(table)
    if f.depth == "class":
        console.print(f"sandbox: {len(f.live)} live rank(s) run the real program: {_ranks(f.live)} (one per class: "
                      "tp = cp = 0, DP index 0, the lowest pipeline stage of its class)")
        console.print(f"virtual: {f.virtual_count:,} rank(s) without a process, each doing its class's live rank's "
                      "work translated to its own position (its TP/CP/DP coordinates and pipeline stage)")
    else:
        several = [c.name for c in f.classes if len(c.sandbox) > 1]
        console.print(f"sandbox: {len(f.live)} live rank(s) run the real program: {_ranks(f.live)} "
                      f"(one model replica: DP index {'0' if f.k == 1 else f'0-{f.k - 1}'})")
        if several:
            console.print(f"  classes with more than one live rank (replica depth keeps a whole replica): "
                          f"{', '.join(several)}")
        console.print(f"virtual: {f.virtual_count:,} rank(s) without a process, each mirroring the live rank of its "
                      f"replica position (same TP/CP/PP coordinates, DP index mod {f.k})")
    mem = Table(title=f"memory here (devices: {','.join(plan.devices)})")
    mem.add_column("what")
    mem.add_column("needed", justify="right")
    mem.add_column("here", justify="right")
    mem.add_row(f"per sandbox rank, most (prism's estimate, class {m.get('per_rank_class')})", _gib(m.get("per_rank")),
                _gib(m.get("per_device")) if plan.devices != ["cpu"] else "")
    if m.get("target"):
        mem.add_row(f"per sandbox rank, most held here (allocator capped at {m['target']['gpu']}'s "
                    f"{_gib(m['target']['cap'])})", _gib(m.get("per_rank_held")), "")
    mem.add_row("per rank by Megatron's formula (most loaded shard; shown, not used)", _gib(formula), "")
    if plan.devices != ["cpu"]:
        mem.add_row("GPU, sandbox", _gib(m.get("gpu_needed")), _gib(m.get("devices_total")))
    mem.add_row("host RAM", _gib(m.get("host_needed")), _gib(m.get("host_available")))
    console.print(mem)
    if m.get("swap_host"):
        console.print(f"swaps: {m['swap_host']}")
    verdict = {True: "[bold green]fits[/bold green]", False: "[bold red]does not fit[/bold red]",
               None: "[bold yellow]not checked[/bold yellow]"}
    c = plan.capture
    if c["mode"] == "serial":
        console.print(f"memory, together: {verdict[m.get('fits')]}" + (f" — {m['why']}" if m.get("why") else ""))
        said = "[bold red]refused[/bold red]" if c.get("refused") else verdict[c["fits"]]
        sp = c.get("second_pass") or {}
        more = (f", up to {sp['at_most']} more (second pass; {sp['counted']} expected)" if sp.get("on") and
                sp.get("at_most") else "")
        console.print(f"capture: serial, {c['captures']} capture(s) one after another, one live rank each{more}: "
                      f"{said} — {c['why']}")
    else:
        console.print(f"memory: {verdict[m.get('fits')]}" + (f" — {m['why']}" if m.get("why") else ""))
    for line in predicted_ooms(plan):
        console.print(f"  {line}")
    console.print(f"verdict: [bold]{plan_verdict(plan)}[/bold]")
    console.print(f"expected emulation time: ~{t['seconds'] / 60:.1f} min for {t['iterations']} iteration(s) "
                  f"({t['model']})")
