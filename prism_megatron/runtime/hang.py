"""The hang report: who waits on what, and who never came — printed and written when no rank can move."""

from __future__ import annotations

import json
import time
from typing import Any


def _fmt_ranks(ranks: list[int]) -> str:
    """Compact rank list: 0-3,8,10-11."""
    out, run = [], []
    for r in sorted(ranks):
        if run and r == run[-1] + 1:
            run.append(r)
        else:
            if run:
                out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out) or "-"


def format_hang_report(coord: Any, stalled: float) -> str:
    """Text report of every rank's pending ops and of every incomplete collective's missing members."""
    now = time.perf_counter()
    lines = [f"prism: hang detected: no rank has made progress for {stalled:.1f} s "
             f"({len(coord.ranks)} ranks; every live rank is blocked in communication)", ""]
    lines.append("Pending ops per rank:")
    for r in sorted(coord.ranks):
        rs = coord.ranks[r]
        if rs.state == "done":
            lines.append(f"  rank {r}: exited (code {rs.exit_code})")
            continue
        if rs.state in ("queued", "starting"):
            lines.append(f"  rank {r}: waiting for a compute slot")
            continue
        waited = now - rs.blocked_since
        for op_id in sorted(rs.blocked_on):
            rec = rs.pending.get(op_id)
            if rec is None:
                continue
            g = coord.groups_by_id[rec.group]
            what = f"{rec.kind} #{rec.seq}" if rec.seq >= 0 else rec.kind
            peer = f" peer {rec.peer}" if rec.peer >= 0 else ""
            data = f"{rec.dtype} shapes {json.loads(rec.shapes)}, " if rec.dtype else ""
            lines.append(f"  rank {r}: {what}{peer} on group {g.name!r} (ranks {_fmt_ranks(g.ranks)}), "
                         f"{data}waiting {waited:.1f} s")
    incomplete = []
    for g in coord.groups_by_id.values():
        for seq, slot in sorted(g.pending.items()):
            arrived = [m.rank for m in slot if m is not None]
            missing = [g.ranks[i] for i, m in enumerate(slot) if m is None]
            incomplete.append(f"  collective #{seq} on group {g.name!r}: arrived {_fmt_ranks(arrived)}; "
                              f"missing {_fmt_ranks(missing)}" + _missing_state(coord, missing))
        for key, q in list(g.p2p.sends.items()) + list(g.p2p.recvs.items()):
            for m in q:
                other = g.ranks[key[1]] if m.kind == "send" else g.ranks[key[0]]
                arrow = f"rank {m.rank} -> rank {other}" if m.kind == "send" else f"rank {m.rank} <- rank {other}"
                incomplete.append(f"  {m.kind} {arrow} on group {g.name!r}: no matching "
                                  f"{'recv' if m.kind == 'send' else 'send'} posted" + _missing_state(coord, [other]))
        for _dst, q in g.p2p.any_recvs.items():
            for m in q:
                incomplete.append(f"  recv (any source) on rank {m.rank}, group {g.name!r}: no send posted")
    if incomplete:
        lines += ["", "Incomplete operations:", *incomplete]
    if getattr(coord, "awaiting_room", None):
        mem = coord.memory
        lines += ["", "Granted a slot but waiting for device memory (no blocked rank left to swap out):"]
        for g in coord.awaiting_room:
            m = mem[g.device]
            lines.append(f"  rank {g.rank}: needs {m.footprint.get(g.rank, 0) / 2**30:.1f} GiB on "
                         f"{coord.device_names[g.device]}; {m.used() / 2**30:.1f} of {m.capacity / 2**30:.1f} GiB "
                         f"resident ({_fmt_ranks(sorted(m.resident))})")
        host = mem[0].host
        if host is not None:
            lines.append(f"  host memory for checkpointed GPU state: {(host.capacity - host.free()) / 2**30:.1f} of "
                         f"{host.capacity / 2**30:.1f} GiB held ({_fmt_ranks(sorted(host.held))}); a rank is only "
                         "swapped out when its state fits (--host-memory)")
    return "\n".join(lines)


def _missing_state(coord: Any, ranks: list[int]) -> str:
    exited = [r for r in ranks if r in coord.ranks and coord.ranks[r].state == "done"]
    never = [r for r in ranks if r not in coord.ranks]
    extra = ""
    if exited:
        extra += f" (exited: {_fmt_ranks(exited)})"
    if never:
        extra += f" (never connected: {_fmt_ranks(never)})"
    return extra
