"""The slice run mode: measure every slice for real, align the slices, write the calibrated graph.

The bare graph's compute times were taken while W ranks shared a few devices. :func:`calibrate`
re-runs the job once per slice (:func:`plan_slices`): the slice's ranks run the user's program,
concurrently (``ranks_per_device`` slots per device, the slice spread over the devices), with real
communication among themselves through the coordinator, while every other rank runs
``virtual_rank.py``, which replays its rank of the bare graph (recorded compute waited without a
slot, the same groups, ops with zeros of the recorded shapes). Each slice's PrismTrace then gives a
:class:`SliceRun` for the slice's ranks, :func:`align_slices` turns them into one timeline and the
result is written with :func:`write_calibrated`. Output layout, all under ``out_dir``::

    virtual-programs/    one program per rank (read by the virtual ranks)
    slice-<i>/           the trace of slice i (logs in slice-<i>.logs/)
    calibrated/          the calibrated graph (format prismcalibrated)

Group ids in a trace follow the order in which ranks first registered each group with the
coordinator, which differs from run to run; group *names* are torch's and equal by construction
(see ``virtual_rank``). So each slice's trace is renumbered to the bare trace's ids by name before
alignment (:func:`renumber_groups`), and a group that the bare run did not have is an error.

This module drives the launcher; the analysis modules of the package still work from files only.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..launcher.config import LaunchConfig
from ..launcher.exit_codes import HANG, MISMATCH, OOM
from ..options import JobOptions
from ..replay.engine import CommSpec, CostFn, replay, zero_cost
from ..replay.graph import graph_from_trace
from ..trace.reader import PrismTrace, read_trace
from .align import AlignError, align_slices, slice_run_from_trace
from .calibrated import read_calibrated, write_calibrated
from .slices import plan_slices
from .virtual_rank import write_programs

VIRTUAL_RANK_SCRIPT = Path(__file__).with_name("virtual_rank.py")
_EXIT = {HANG: "hang", MISMATCH: "mismatch", OOM: "out of memory under the target's cap"}


class SliceRunError(RuntimeError):
    """A slice's run failed; the message names the slice, its ranks, the exit code and the logs."""


def _say(msg: str) -> None:
    print(f"calibrate: {msg}", file=sys.stderr, flush=True)


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"


def renumber_groups(trace: PrismTrace, reference: list[dict[str, Any]], index: int = 0) -> PrismTrace:
    """``trace`` with its group ids replaced by those of the same-named groups in ``reference``.

    ``reference`` is the bare trace's manifest ``groups``. Raises AlignError for a group that is not
    there or has other ranks (the program did not create the same groups as in the bare run).
    """
    ref = {g["name"]: g for g in reference}
    mapping: dict[int, int] = {}
    for g in trace.manifest["groups"]:
        r = ref.get(g["name"])
        if r is None or list(r["ranks"]) != list(g["ranks"]):
            why = "which the bare trace does not have" if r is None else f"but the bare trace says {r['ranks']}"
            raise AlignError(f"{trace.path}: slice {index} has process group {g['name']!r} with ranks {g['ranks']}, "
                             f"{why}: the program must create the same groups in every run")
        mapping[g["id"]] = r["id"]
    if all(k == v for k, v in mapping.items()):
        return trace
    lut = np.full(max(mapping) + 1, -1, dtype=np.int32)
    for k, v in mapping.items():
        lut[k] = v
    i = trace.ops.schema.get_field_index("group")
    ops = trace.ops.set_column(i, trace.ops.schema.field(i),
                               pa.array(lut[trace.ops.column(i).to_numpy()], pa.int32()))
    manifest = dict(trace.manifest, groups=sorted(({**g, "id": mapping[g["id"]]} for g in trace.manifest["groups"]),
                                                  key=lambda g: g["id"]))
    return PrismTrace(trace.path, manifest, ops, trace.marks, trace.slots)


def slice_devices(ranks: Sequence[int], ranks_per_device: int) -> dict[int, int]:
    """Device index of each slice rank: ``ranks_per_device`` per device, in rank order."""
    return {r: i // ranks_per_device for i, r in enumerate(sorted(ranks))}


def calibrate(bare_trace_dir: str | Path, out_dir: str | Path, *, script: str | Path, script_args: Sequence[str] = (),
              devices: Sequence[str] = ("cpu",), ranks_per_device: int = 1, cost: CostFn | None = None,
              cost_name: str = "", use_model: Callable[[CommSpec], bool] | None = None,
              couple: float | Sequence[int] = 0.5, hang_timeout: float = JobOptions.hang_timeout,
              threads_per_rank: int = 1, preload: Sequence[str] = (), rank_setup: Sequence[str] = (),
              say: Callable[[str], None] = _say) -> Path:
    """Run one slice run per slice of the bare trace, align them and write the calibrated graph.

    ``script``/``script_args`` are the program the bare trace was captured from; ``devices`` are
    'cpu' or CUDA indices, each offering ``ranks_per_device`` slots. ``cost`` prices the ops no
    slice measured whole (needed whenever such ops exist), ``use_model`` forces it for ops the
    machine cannot exhibit (see ``align_slices``). ``preload``/``rank_setup`` as in LaunchConfig (the
    Megatron integration's CPU mode and seams, for every rank). Returns the calibrated graph's directory.
    Raises SliceError (no slice plan), VirtualRankError (the trace cannot be replayed),
    SliceRunError (a slice's run failed) or AlignError (the measurements do not fit together).
    """
    from ..launcher.launch import launch  # the fork-server launcher: only when slices are run

    bare_dir, out = Path(bare_trace_dir), Path(out_dir)
    bare = read_trace(bare_dir)
    graph = graph_from_trace(bare, gpu_times=False)  # virtual ranks wait the one-clock compute
    devices = list(devices)
    slices = plan_slices(graph, len(devices), ranks_per_device, couple=couple)
    world = bare.world_size
    say(f"{world} ranks in {len(slices)} slice(s) of at most {len(devices) * ranks_per_device} "
        f"({len(devices)} device(s) x {ranks_per_device})")
    out.mkdir(parents=True, exist_ok=True)
    programs = write_programs(bare, graph, out / "virtual-programs")
    gpus_per_node = int(bare.manifest["job"].get("gpus_per_node", 8))
    runs = []
    for s in slices:
        t0 = time.perf_counter()
        say(f"slice {s.index + 1}/{len(slices)}: ranks {_ranks(s.ranks)} run {Path(script).name} for real, "
            f"{world - len(s.ranks)} virtual rank(s) replay {bare_dir}")
        cfg = LaunchConfig(
            script=Path(script), script_args=list(script_args), world_size=world, devices=devices,
            slots_per_device=ranks_per_device, hang_timeout=hang_timeout, trace_dir=out / f"slice-{s.index}",
            gpus_per_node=gpus_per_node, log_ranks=[], threads_per_rank=threads_per_rank, track_memory=False,
            preload=list(preload), rank_setup=list(rank_setup),
            rank_scripts={r: (VIRTUAL_RANK_SCRIPT, [str(programs)]) for r in range(world) if r not in s.ranks},
            rank_devices=slice_devices(s.ranks, ranks_per_device),
        )
        code = launch(cfg)
        if code != 0:
            raise SliceRunError(f"slice {s.index} (ranks {_ranks(s.ranks)}) ended with exit code {code}"
                                f"{' (' + _EXIT[code] + ')' if code in _EXIT else ''}; logs in {cfg.log_dir}")
        trace = renumber_groups(read_trace(cfg.trace_dir), bare.manifest["groups"], s.index)
        runs.append(slice_run_from_trace(trace, s.ranks, s.index))
        say(f"slice {s.index + 1}/{len(slices)} done in {time.perf_counter() - t0:.1f} s; trace {cfg.trace_dir}")
    cg = align_slices(runs, cost, use_model=use_model, trace=str(bare_dir), cost_name=cost_name)
    path = write_calibrated(out / "calibrated", cg)
    say(f"calibrated graph written to {path} ({cg.graph.notes[-1]})")
    return path


def predicted_iterations(bare_trace_dir: str | Path, calibrated_dir: str | Path,
                         cost: CostFn | None = None) -> list[tuple[int, float | None, float | None]]:
    """(iteration, bare prediction, calibrated prediction) in seconds, None where one has no such iteration.

    The bare graph is replayed with ``cost`` (default: free communication), the calibrated graph
    with its own durations.
    """
    bare = replay(graph_from_trace(read_trace(bare_trace_dir)), cost or zero_cost).iterations()
    cal = read_calibrated(calibrated_dir).replay().iterations()
    b, c = {it.number: it.time for it in bare}, {it.number: it.time for it in cal}
    return [(n, b.get(n), c.get(n)) for n in sorted(set(b) | set(c))]


def calibrate_job(bare_trace_dir: str | Path, out_dir: str | Path, *, script: str | Path, script_args: Sequence[str],
                  devices: Sequence[str], ranks_per_device: int, cluster: str | None = None,
                  preload: Sequence[str] = (), rank_setup: Sequence[str] = ()
                  ) -> tuple[Path, list[tuple[int, float | None, float | None]], str]:
    """:func:`calibrate` with the ops no slice measured whole costed by ``cluster`` (free without one);
    returns the calibrated graph's directory, the bare vs calibrated iteration times and what costed
    those ops. Shared by ``prism-megatron calibrate`` and ``run --prism-calibrate on``."""
    cost, use_model, name = zero_cost, None, "free (no cluster profile)"
    if cluster is not None:
        from .align import spans_nodes
        from .costmodel import CollectiveCostModel
        from .profiles import load_profile

        cost, name = CollectiveCostModel(load_profile(cluster)), f"cluster profile {cluster}"
        use_model = spans_nodes(int(read_trace(bare_trace_dir).manifest["job"].get("gpus_per_node", 8)))
    path = calibrate(bare_trace_dir, out_dir, script=script, script_args=script_args, devices=devices,
                     ranks_per_device=ranks_per_device, cost=cost, cost_name=name, use_model=use_model,
                     preload=preload, rank_setup=rank_setup)
    return path, predicted_iterations(bare_trace_dir, path, cost), name


def format_iterations(rows: list[tuple[int, float | None, float | None]], cost_name: str) -> list[str]:
    """The bare vs calibrated table as lines of text."""
    def ms(s: float | None) -> str:
        return "-" if s is None else f"{s * 1e3:.3f} ms"

    lines = [f"predicted iteration times (ops no slice measured whole: {cost_name}):",
             f"  {'iteration':>9} {'bare graph':>12} {'calibrated':>12}"]
    return lines + [f"  {it:>9} {ms(b):>12} {ms(c):>12}" for it, b, c in rows]
