"""A virtual rank: a logical rank that replays its rank's recorded behaviour instead of the program.

In a slice run (:mod:`.slice_run`) the slice's ranks run the real program while every other rank
runs this script under the same prism launcher, so it talks to the coordinator exactly like a real
rank: it creates the same process groups, issues the same ops (zeros of the recorded shapes and
dtypes) and waits its recorded compute durations.

Two halves, so that the trace is read once per calibration rather than once per virtual rank:
:func:`write_programs` (in the calibrating process) turns the bare trace into one small JSON
*program* per rank — a step per event of the rank in ``graph_from_trace`` (compute, op, wait, mark),
1:1 with the graph's events so a wait names its ops by event index; the script (run as
``virtual_rank.py PROGRAM_DIR`` with ``RANK`` set by the launcher) executes ``rank-<RANK>.json``.

The rules:

- **Groups.** The coordinator matches a group by its torch name, and ids follow from the order
  of first registration, so the names must come out identical. torch (checked on 2.13) names a
  group ``str(counter)`` — a counter that *every* rank advances at every ``new_group`` call, member
  or not (``init_process_group`` takes "0") — or, with ``use_local_synchronization`` (and
  ``split_group``), ``sha1("<sorted ranks joined by _>_<k>")`` where ``k`` is the number of groups
  the creating rank belonged to then. A virtual rank therefore calls ``new_group`` for every
  counter-named group in number order and places each of its hashed groups where it held exactly
  ``k`` groups (``k`` is solved from the recorded name). Every created name is compared with the
  recorded one; a difference (a newer torch, groups destroyed and re-made) is an error naming the
  group, never a silent mismatch. Group *ids* in different runs' traces may differ (they follow
  arrival order at the coordinator); the slice run renumbers them by name.
- **Compute.** A compute segment is waited with the runtime's ``idle`` (slot given back during
  the sleep), so virtual ranks take no compute time from the slice's real ranks; waits shorter
  than ``MIN_IDLE`` are slept holding the slot, as the hand-over would cost as much.
- **Waits.** A synchronous op is issued synchronously. An async op is waited where the graph has
  a ``Wait`` on it: ``graph_from_trace`` places one where the real rank gave its slot back on
  incomplete async ops (from the slot log); an async op the real rank found complete when it
  waited is awaited with the rank's next blocking op, or at the end (the graph's rule).
- **Markers.** Scheduling-unit spans (B/E: iteration, microbatch...) are re-emitted with
  ``trace.markers.span`` so the slice's trace has iteration boundaries for every rank; instants
  (memory, oom, layout...) describe the real rank's process and are not.
- Contributions are zeros, except for small inputs the trace recorded (PrismTrace v3 ops.payload:
  integer/byte tensors up to 64 KiB, floats up to 64 bytes): those are contributed as recorded, so
  object collectives (Megatron compares gathered parameter names at set-up) and flags a program
  branches on match the real run. Other results differ numerically (timing does not depend on them).
  An ``all_to_all_single`` is issued with the split sizes the trace recorded (PrismTrace v3); a trace
  without them (v1/v2) replays only even splits: a dim 0 that does not split evenly is refused by
  :func:`write_programs`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from prism_megatron.ops import OPS

FORMAT = "prism-virtual-rank"
VERSION = 1
MIN_IDLE = 1e-3  # seconds; shorter compute waits keep the slot


class VirtualRankError(ValueError):
    """A rank's recorded behaviour cannot be replayed (group naming, an op kind or layout)."""


def program_file(program_dir: str | Path, rank: int) -> Path:
    return Path(program_dir) / f"rank-{rank}.json"


# --- groups ----------------------------------------------------------------------------------------
def _hashed_position(group: dict[str, Any], limit: int) -> int | None:
    """k such that torch's hashed name of the group's ranks with k groups held is its name, else None."""
    joined = "_".join(map(str, group["ranks"]))
    for k in range(limit + 1):
        if hashlib.sha1(f"{joined}_{k}".encode(), usedforsecurity=False).hexdigest() == group["name"]:
            return k
    return None


def creation_order(groups: list[dict[str, Any]], rank: int) -> list[dict[str, Any]]:
    """The ``new_group`` calls ``rank`` makes so torch names every group as recorded (module docstring).

    ``groups`` are manifest entries (id, name, ranks, backend). Returns entries with ``how``:
    'world' (init_process_group), 'counter' (new_group, also by non-members) or 'local'
    (new_group with use_local_synchronization, members only), in call order.
    """
    by_number: dict[int, list[dict[str, Any]]] = {}
    for g in groups:
        if g["name"].isdigit():
            by_number.setdefault(int(g["name"]), []).append(g)
    if len(by_number.get(0, ())) > 1:
        raise VirtualRankError("the program made its default group more than once (init_process_group after "
                               "destroy_process_group): torch's group numbering restarts, which cannot be reproduced")
    # one name may stand for different groups on different ranks (runtime.groups): this rank made its own
    counter = sorted((n, next((g for g in gs if rank in g["ranks"]), gs[0])) for n, gs in by_number.items())
    numbers = [n for n, _ in counter]
    if numbers != list(range(len(numbers))):
        missing = sorted(set(range(max(numbers, default=-1) + 1)) - set(numbers))
        raise VirtualRankError(f"process groups named {missing} are missing from the trace (names jump in "
                               f"{numbers}): torch's group numbering cannot be reproduced")
    if not counter:
        raise VirtualRankError("the trace has no group named '0' (torch's default group)")
    local: list[tuple[int, dict[str, Any]]] = []
    member_of = sum(rank in g["ranks"] for g in groups)  # k is below this
    for g in groups:
        if g["name"].isdigit() or rank not in g["ranks"]:
            continue
        k = _hashed_position(g, member_of)
        if k is None:
            raise VirtualRankError(f"process group {g['name']!r} (ranks {g['ranks']}) is named neither by torch's "
                                   "counter nor by its hash of the ranks: cannot re-create it under that name")
        local.append((k, g))
    local.sort(key=lambda x: x[0])
    plan: list[dict[str, Any]] = []
    held, li = 0, 0

    def place_local() -> None:
        nonlocal held, li
        while li < len(local) and local[li][0] == held:
            plan.append(dict(local[li][1], how="local"))
            held, li = held + 1, li + 1

    for n, g in counter:
        place_local()
        plan.append(dict(g, how="world" if n == 0 else "counter"))
        held += rank in g["ranks"]
    place_local()
    if li < len(local):
        k, g = local[li]
        raise VirtualRankError(f"process group {g['name']!r} (ranks {g['ranks']}) was created when rank {rank} "
                               f"belonged to {k} group(s), which no order of the recorded groups reproduces")
    return plan


# --- ops -------------------------------------------------------------------------------------------
def split_shapes(kind: str, shapes: list[list[int]], size: int, is_root: bool,
                 splits: list | None = None) -> tuple[list, list]:
    """(input shapes, output shapes) of a recorded op, whose ``shapes`` lists inputs then outputs.

    The split follows what the prism backend sends per kind; raises VirtualRankError for a layout
    that cannot be replayed.
    """
    n = len(shapes)
    op = OPS.get(kind)
    if op is None:
        raise VirtualRankError(f"op kind {kind!r} cannot be replayed by a virtual rank")
    if op.paired:
        if n % 2 or not n or (kind == "all_to_all" and n != 2):
            raise VirtualRankError(f"{kind} with {n} tensor shape(s) cannot be replayed")
        if kind == "all_to_all" and not splits and (shapes[0][0] if shapes[0] else 1) % size:
            raise VirtualRankError(f"all_to_all_single of shape {shapes[0]} over {size} ranks has uneven splits, "
                                   "whose sizes this trace (before v3) does not record: it cannot be replayed")
        return shapes[: n // 2], shapes[n // 2:]
    n_in, n_out = op.layout(size, is_root)
    if n != n_in + n_out:
        raise VirtualRankError(f"{kind} with {n} tensor shape(s) cannot be replayed (expected {n_in + n_out})")
    return shapes[:n_in], shapes[n_in:]


def inputs(torch: Any, payload: list[str] | None, shapes: list, dtype: Any) -> list:
    """The op's inputs: the bytes the real rank contributed where the trace has them (small data a
    program branches on, e.g. the pickles of an object collective), zeros of the shapes otherwise."""
    if not payload or len(payload) != len(shapes):
        return [torch.zeros(s, dtype=dtype) for s in shapes]
    out = []
    for data, shape in zip(payload, shapes, strict=True):
        raw = bytearray(base64.b64decode(data))
        t = torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if raw else torch.zeros(0, dtype=dtype)
        out.append(t.reshape(shape).clone())
    return out


def split_rows(splits: list | None, inp: Any, out: Any) -> tuple[list[int] | None, list[int] | None]:
    """The recorded all_to_all_single split sizes (bytes per group rank) as rows of dim 0; None: even."""
    if not splits:
        return None, None

    def rows(nbytes: list[int], t: Any) -> list[int]:
        row = t.element_size() * (t[0].numel() if t.dim() and t.shape[0] else 1)
        return [b // row for b in nbytes]

    return rows(splits[0], inp), rows(splits[1], out)


# --- the program file ------------------------------------------------------------------------------
def rank_program(trace: Any, graph: Any, rank: int) -> dict[str, Any]:
    """The program of ``rank`` from a bare trace and its ``graph_from_trace`` graph (see module docstring)."""
    from prism_megatron.calibration.align import comm_rows
    from prism_megatron.replay.graph import Comm, Compute, Mark, Wait

    groups = trace.manifest["groups"]
    by_id = {g["id"]: g for g in groups}
    rows = iter(comm_rows(graph, trace, rank))
    steps: list[dict[str, Any]] = []
    for ev in graph.events[rank]:
        if isinstance(ev, Compute):
            steps.append({"t": "compute", "s": ev.duration})
        elif isinstance(ev, Comm):
            row = next(rows)
            step = {"t": "op", "kind": ev.kind, "group": by_id[ev.group]["name"], "seq": ev.seq, "peer": ev.peer,
                    "root": ev.root, "dtype": row["dtype"], "shapes": json.loads(row["shapes"]),
                    "reduce_op": row["reduce_op"], "async_op": ev.async_op,
                    "splits": json.loads(row["splits"]) if row.get("splits") else None,
                    "payload": json.loads(row["payload"]) if row.get("payload") else None}
            try:
                size = len(by_id[ev.group]["ranks"])
                split_shapes(ev.kind, step["shapes"], size, ev.root == rank, step["splits"])
            except VirtualRankError as e:
                raise VirtualRankError(f"{trace.path}: rank {rank} op {row['index']}: {e}") from None
            steps.append(step)
        elif isinstance(ev, Wait):
            steps.append({"t": "wait", "refs": list(ev.refs)})
        elif isinstance(ev, Mark):
            steps.append({"t": "mark", "name": ev.name, "phase": ev.phase, "attrs": ev.attrs})
    return {"format": FORMAT, "version": VERSION, "rank": rank, "world_size": trace.world_size,
            "trace": str(trace.path), "groups": creation_order(groups, rank), "steps": steps}


def write_programs(trace: Any, graph: Any, out_dir: str | Path, ranks: list[int] | None = None) -> Path:
    """Write ``rank-<r>.json`` for ``ranks`` (default: all) of a bare trace into ``out_dir``; return it.

    Everything that cannot be replayed is found here, before any rank starts.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for r in range(trace.world_size) if ranks is None else ranks:
        program_file(out, r).write_text(json.dumps(rank_program(trace, graph, r)) + "\n", encoding="utf-8")
    return out


def read_program(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        program = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise VirtualRankError(f"virtual-rank program {path}: cannot be read: {e}") from None
    if not isinstance(program, dict) or program.get("format") != FORMAT or program.get("version") != VERSION:
        raise VirtualRankError(f"virtual-rank program {path}: field 'format'/'version' is not {FORMAT} v{VERSION}")
    return program


# --- execution (inside a logical rank) -------------------------------------------------------------
def _create_groups(dist: Any, plan: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    groups: dict[str, Any] = {}
    for g in plan:
        backend = None if g["backend"] in ("undefined", "prism") else g["backend"]
        if g["how"] == "world":
            dist.init_process_group(backend)
            pg = dist.group.WORLD
        else:
            pg = dist.new_group(g["ranks"], backend=backend, use_local_synchronization=g["how"] == "local")
        if rank not in g["ranks"]:
            continue
        name = pg.group_name
        if name != g["name"]:
            raise VirtualRankError(f"rank {rank}: re-creating process group {g['name']!r} (ranks {g['ranks']}) gave "
                                   f"it the name {name!r}; the coordinator would not match it with the real ranks'")
        groups[g["name"]] = pg
    return groups


def _redop(dist: Any, name: str) -> Any:
    if name == "premul_sum":
        return dist._make_nccl_premul_sum(1.0)  # the factor is not in the trace; the coordinator matches names
    return getattr(dist.ReduceOp, name.upper()) if name else dist.ReduceOp.SUM


def _issue(torch: Any, dist: Any, step: dict[str, Any], pg: Any, rank: int) -> Any:
    """Issue one recorded op with zeros; returns its Work (async) or None (synchronous, already done)."""
    kind, a, root, peer = step["kind"], step["async_op"], step["root"], step["peer"]
    dtype = getattr(torch, step["dtype"]) if step["dtype"] else torch.float32
    ins_s, outs_s = split_shapes(kind, step["shapes"], pg.size(), root == rank, step.get("splits"))
    ins = inputs(torch, step.get("payload"), ins_s, dtype)
    outs = ins if kind == "all_reduce" else [torch.zeros(s, dtype=dtype) for s in outs_s]  # in place
    op = _redop(dist, step["reduce_op"]) if step["reduce_op"] else dist.ReduceOp.SUM
    one = {
        "all_reduce": lambda i, o: dist.all_reduce(i, op, group=pg, async_op=a),
        "all_gather": lambda i, o: dist.all_gather_into_tensor(o, i, group=pg, async_op=a),
        "reduce_scatter": lambda i, o: dist.reduce_scatter_tensor(o, i, op, group=pg, async_op=a),
    }
    if kind in one:
        if len(ins) == 1:
            return one[kind](ins[0], outs[0])
        with dist._coalescing_manager(group=pg, async_ops=a) as cm:  # one coalesced op, as Megatron's DDP issues
            for i, o in zip(ins, outs, strict=True):
                one[kind](i, o)
        return cm if a else None
    if kind == "all_to_all":
        in_rows, out_rows = split_rows(step.get("splits"), ins[0], outs[0])
        return dist.all_to_all_single(outs[0], ins[0], output_split_sizes=out_rows, input_split_sizes=in_rows,
                                      group=pg, async_op=a)
    if kind == "all_gather_list":
        return dist.all_gather(outs, ins[0], group=pg, async_op=a)
    if kind == "reduce_scatter_list":
        return dist.reduce_scatter(outs[0], ins, op, group=pg, async_op=a)
    if kind == "all_to_all_list":
        return dist.all_to_all(outs, ins, group=pg, async_op=a)
    if kind == "broadcast":
        return dist.broadcast((ins or outs)[0], src=root, group=pg, async_op=a)
    if kind == "reduce":
        return dist.reduce(ins[0], dst=root, op=op, group=pg, async_op=a)
    if kind == "gather":
        return dist.gather(ins[0], outs if root == rank else None, dst=root, group=pg, async_op=a)
    if kind == "scatter":
        return dist.scatter(outs[0], ins if root == rank else None, src=root, group=pg, async_op=a)
    if kind == "barrier":
        return dist.barrier(group=pg, async_op=a)
    if kind == "send":
        work = dist.isend(ins[0], dst=peer, group=pg)
    else:
        work = dist.irecv(outs[0], src=peer, group=pg)
    if a:
        return work
    work.wait()
    return None


def run_program(program: dict[str, Any]) -> None:
    """Replay ``program`` in this logical rank (prism must be installed: ``prism launch`` does it)."""
    import torch
    import torch.distributed as dist

    from prism_megatron.runtime.backend import idle
    from prism_megatron.trace.markers import span

    rank = int(os.environ["RANK"])
    if program["rank"] != rank or program["world_size"] != int(os.environ["WORLD_SIZE"]):
        raise VirtualRankError(f"virtual-rank program of rank {program['rank']} of {program['world_size']} run as "
                               f"rank {rank} of {os.environ['WORLD_SIZE']}")
    groups = _create_groups(dist, program["groups"], rank)
    works: dict[int, Any] = {}
    spans: list[tuple[str, Any]] = []
    for i, step in enumerate(program["steps"]):
        t = step["t"]
        if t == "compute":
            if step["s"] >= MIN_IDLE:
                idle(step["s"])
            elif step["s"] > 0:
                time.sleep(step["s"])
        elif t == "op":
            work = _issue(torch, dist, step, groups[step["group"]], rank)
            if work is not None:
                works[i] = work
        elif t == "wait":
            for ref in step["refs"]:
                work = works.pop(ref, None)
                if work is not None:
                    work.wait()
        elif step["phase"] == "B":
            s = span(step["name"], **step["attrs"])
            s.__enter__()
            spans.append((step["name"], s))
        elif step["phase"] == "E":
            at = max((j for j, (name, _) in enumerate(spans) if name == step["name"]), default=None)
            if at is not None:
                spans.pop(at)[1].__exit__(None, None, None)
    for work in works.values():
        work.wait()
    for _, s in reversed(spans):
        s.__exit__(None, None, None)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: virtual_rank.py PROGRAM_DIR  (run as a logical rank by the prism launcher)")
    run_program(read_program(program_file(argv[0], int(os.environ["RANK"]))))


if __name__ == "__main__":
    main(sys.argv[1:])
