"""The hang and stall reports: who waits on what, who keeps them waiting and what it is doing, and who never
came — printed and written when no rank can move, or when the others have waited on one for the hang timeout."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from prism_megatron.runtime.governor import MemoryGovernor
from prism_megatron.runtime.groups import GroupTable
from prism_megatron.runtime.passthrough import waiting_receives
from prism_megatron.runtime.ranks import RankState, RankStatus
from prism_megatron.runtime.reaper import process_state

#: Seconds to wait before reporting a hang whose ops wait on a rank that has exited: it cannot come back,
#: so the job need not wait the whole hang timeout (the grace lets messages already sent arrive).
EXITED_GRACE = 1.0


class HangDetector:
    """No rank can make progress: every live rank is blocked in communication (or granted a slot but
    waiting for device memory that no blocked rank can free) and no message came for ``timeout`` s
    (``EXITED_GRACE`` when they wait on a rank that exited). Or a stall: some ranks wait on others that
    hold them up — computing in a slot, stopped, or outside the runtime — with no message for ``timeout`` s."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.last_progress = time.perf_counter()
        self._reported = False

    def progress(self) -> None:
        """A message came in."""
        self.last_progress = time.perf_counter()

    def reported(self) -> None:
        """The job is ending with a report: look no further."""
        self._reported = True

    def stalled(self, ranks: dict[int, RankState], world_size: int, awaiting_room: bool,
                waits_on_exited: Callable[[], bool] = lambda: False) -> float | None:
        """Seconds for which no rank could move, once that is a hang; None otherwise."""
        quiet = time.perf_counter() - self.last_progress
        if self._reported or quiet < min(self.timeout, EXITED_GRACE):
            return None  # a message came in recently: no need to look at every rank (this runs every loop turn)
        live = [r for r in ranks.values() if r.state != RankStatus.DONE]
        if len(ranks) < world_size:
            return None  # ranks still starting may yet post the missing ops
        stuck_on_memory = awaiting_room and not any(r.state == RankStatus.RUNNING for r in live)
        if not live or (any(r.state != RankStatus.BLOCKED for r in live) and not stuck_on_memory):
            return None
        stalled = time.perf_counter() - max(self.last_progress, max(r.blocked_since for r in live))
        if stalled >= self.timeout:
            return stalled
        return stalled if stalled >= EXITED_GRACE and waits_on_exited() else None

    def holdouts(self, ranks: dict[int, RankState], world_size: int) -> list[int] | None:
        """The ranks that have kept every other live rank waiting for ``timeout`` s without a message: they
        compute in a slot, are stopped, run outside the runtime or never connected. None when there is no
        such stall (a sleeping rank, RankClient.idle, will move again)."""
        if self._reported or time.perf_counter() - self.last_progress < self.timeout:
            return None
        live = [r for r in ranks.values() if r.state != RankStatus.DONE]
        if not any(r.state == RankStatus.BLOCKED for r in live) or any(r.state == RankStatus.IDLE for r in live):
            return None
        held = [r.rank for r in live if r.state in (RankStatus.RUNNING, RankStatus.STARTING)]
        never = [r for r in range(world_size) if r not in ranks] if len(ranks) < world_size else []
        return sorted(held + never) or None


def waits_on_exited(ranks: dict[int, RankState], groups: GroupTable) -> bool:
    """Whether an incomplete op waits on a rank that has exited (it can never complete)."""
    def exited(r: int) -> bool:
        return r in ranks and ranks[r].state == RankStatus.DONE

    for g in groups:
        for slot in g.pending.values():
            if any(m is None and exited(g.ranks[i]) for i, m in enumerate(slot)):
                return True
        for key, q in list(g.p2p.sends.items()) + list(g.p2p.recvs.items()):
            for m in q:
                if exited(g.ranks[key[1]] if m.kind == "send" else g.ranks[key[0]]):
                    return True
        if any(s.waiting and exited(g.ranks[u]) for (u, _), s in g.passthrough.items()):
            return True  # a receive from a virtual neighbour whose stand-in's sender has exited
    return False


def _doing(rs: RankState | None, now: float) -> str:
    """What a rank that keeps the others waiting is doing."""
    if rs is None:
        return "never connected to the runtime (its program has not called init_process_group)"
    state = process_state(rs.pid) if rs.pid else None
    if state in ("T", "t"):
        return f"stopped (process {rs.pid} is in state T: SIGSTOP, or a debugger); SIGCONT resumes it"
    if state in ("Z", "X", None) and rs.pid:
        return f"gone (process {rs.pid} ended without telling the runtime)"
    if rs.state == RankStatus.RUNNING and state in ("S", "D", "I"):
        return (f"outside the runtime: it has held a compute slot for {now - rs.grant_t:.1f} s but waits on "
                f"something else (process {rs.pid} in state {state}: a sleep, I/O, a lock, another process)")
    if rs.state == RankStatus.RUNNING:
        return (f"computing: it has held a compute slot for {now - rs.grant_t:.1f} s without calling into the "
                f"runtime (process {rs.pid}, state {state})")
    return (f"outside the runtime: connected but has not asked for a compute slot (process {rs.pid}, state {state})")


def format_stall_report(ranks: dict[int, RankState], groups: GroupTable, governor: MemoryGovernor,
                        holdouts: list[int], timeout: float, now: float) -> str:
    """Text report of a stall: the ranks that keep the others waiting, what each is doing, what the others
    wait on. ``now``: the recorder's clock (that of ``RankState.grant_t``)."""
    lines = [f"prism: stall: rank(s) {_fmt_ranks(holdouts)} kept the other ranks waiting for over {timeout:g} s "
             "(--hang-timeout) without a message to the runtime", ""]
    for r in holdouts:
        lines.append(f"  rank {r}: {_doing(ranks.get(r), now)}")
    own = tuple(f"  rank {r}:" for r in holdouts)
    rest = format_hang_report(ranks, groups, governor, timeout).split("\n")[2:]
    lines += ["", *(line for line in rest if not line.startswith(own))]
    lines.append("If a rank is busy on purpose (a long checkpoint save, a slow first step), raise --hang-timeout.")
    return "\n".join(lines)


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


def format_hang_report(ranks: dict[int, RankState], groups: GroupTable, governor: MemoryGovernor,
                       stalled: float) -> str:
    """Text report of every rank's pending ops and of every incomplete collective's missing members."""
    now = time.perf_counter()
    lines = [f"prism: hang detected: no rank has made progress for {stalled:.1f} s "
             f"({len(ranks)} ranks; every live rank is blocked in communication)", ""]
    lines.append("Pending ops per rank:")
    for r in sorted(ranks):
        rs = ranks[r]
        if rs.state == RankStatus.DONE:
            lines.append(f"  rank {r}: exited (code {rs.exit_code})")
            continue
        if rs.state in (RankStatus.QUEUED, RankStatus.STARTING):
            lines.append(f"  rank {r}: waiting for a compute slot")
            continue
        waited = now - rs.blocked_since
        for op_id in sorted(rs.blocked_on):
            rec = rs.pending.get(op_id)
            if rec is None:
                continue
            g = groups.by_id[rec.group]
            what = f"{rec.kind} #{rec.seq}" if rec.seq >= 0 else rec.kind
            peer = f" peer {rec.peer}" if rec.peer >= 0 else ""
            data = f"{rec.dtype} shapes {json.loads(rec.shapes)}, " if rec.dtype else ""
            lines.append(f"  rank {r}: {what}{peer} on group {g.name!r} (ranks {_fmt_ranks(g.ranks)}), "
                         f"{data}waiting {waited:.1f} s")
    incomplete = []
    for g in groups:
        for seq, slot in sorted(g.pending.items()):
            arrived = [m.rank for m in slot if m is not None]
            pos = g.fold.live_positions if g.fold is not None else range(len(g.ranks))  # slots: live members
            missing = [g.ranks[pos[i]] for i, m in enumerate(slot) if m is None]
            incomplete.append(f"  collective #{seq} on group {g.name!r}: arrived {_fmt_ranks(arrived)}; "
                              f"missing {_fmt_ranks(missing)}" + _missing_state(ranks, missing))
        for key, q in list(g.p2p.sends.items()) + list(g.p2p.recvs.items()):
            for m in q:
                other = g.ranks[key[1]] if m.kind == "send" else g.ranks[key[0]]
                arrow = f"rank {m.rank} -> rank {other}" if m.kind == "send" else f"rank {m.rank} <- rank {other}"
                incomplete.append(f"  {m.kind} {arrow} on group {g.name!r}: no matching "
                                  f"{'recv' if m.kind == 'send' else 'send'} posted" + _missing_state(ranks, [other]))
        for _dst, q in g.p2p.any_recvs.items():
            for m in q:
                incomplete.append(f"  recv (any source) on rank {m.rank}, group {g.name!r}: no send posted")
        incomplete += [f"  {line}" for line in waiting_receives(g)]
    if incomplete:
        lines += ["", "Incomplete operations:", *incomplete]
    if governor.awaiting_room:
        mem = governor.memory
        lines += ["", "Granted a slot but waiting for device memory (no blocked rank left that a swap out may move):"]
        for g in governor.awaiting_room:
            m = mem[g.device]
            need, source = governor.need(g.rank)
            why = {"own": "its own peak", "class": "its class's peak"}.get(source, "not measured yet: the bound")
            lines.append(f"  rank {g.rank}: needs {need / 2**30:.1f} GiB ({why}) on "
                         f"{governor.device_names[g.device]}; {m.used() / 2**30:.1f} of {m.capacity / 2**30:.1f} GiB "
                         f"resident ({_fmt_ranks(sorted(m.resident))})")
            kept = m.kept_in(governor._evictable(g.device, exclude=g.rank))
            for r, host_bytes in kept:
                lines.append(f"    rank {r} stays: its swap out needs {host_bytes / 2**30:.1f} GiB of host memory, "
                             f"{m.host.free() / 2**30:.1f} GiB are left")
            if kept and (why := m.held_out(g.rank)):
                lines.append(f"    {why}")
        host = mem[0].host
        if host is not None:
            lines.append(f"  host memory for checkpointed GPU state: {(host.capacity - host.free()) / 2**30:.1f} of "
                         f"{host.capacity / 2**30:.1f} GiB held ({_fmt_ranks(sorted(host.held))}); a rank is only "
                         "swapped out when its state fits (--host-memory)")
    return "\n".join(lines)


def _missing_state(states: dict[int, RankState], ranks: list[int]) -> str:
    exited = [r for r in ranks if r in states and states[r].state == RankStatus.DONE]
    never = [r for r in ranks if r not in states]
    extra = ""
    if exited:
        extra += f" (exited: {_fmt_ranks(exited)})"
    if never:
        extra += f" (never connected: {_fmt_ranks(never)})"
    return extra
