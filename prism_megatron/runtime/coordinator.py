"""The coordinator: one sidecar process per job that every logical rank talks to.

It matches ops by (group, sequence number), checks that members agree, performs the op on host
memory in a fixed order, and returns results; it owns the slot scheduler, notices when no rank can
make progress (hang report), hosts the job's TCPStore (as torchrun's agent does, so ranks
rendezvous whatever order they start in), and writes the PrismTrace when the launcher says the
job ended. Single-threaded: every decision happens in one loop, in arrival order.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import selectors
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

import torch

from prism_megatron.runtime import collectives as C
from prism_megatron.runtime import protocol as P
from prism_megatron.runtime.groups import GroupMismatch, GroupTable
from prism_megatron.runtime.hang import format_hang_report
from prism_megatron.runtime.matching import Member, P2PQueues, check_collective, check_p2p, desc_bytes
from prism_megatron.runtime.memory import DeviceMemory, HostBudget
from prism_megatron.runtime.nvml import FootprintCheck, NvmlUnavailable, nvml_process_memory
from prism_megatron.runtime.shm import SegmentMap
from prism_megatron.runtime.slots import Grant, ResidentFirstPolicy, SlotScheduler
from prism_megatron.runtime.swap import BudgetSwapper, CudaCheckpointSwapper, Swapper, SwapUnavailable


@dataclass
class OpRecord:
    """One rank's op, as it goes into the trace (ops.parquet columns)."""

    rank: int
    index: int
    kind: str
    group: int
    seq: int
    peer: int
    root: int
    bytes: int
    dtype: str
    shapes: str
    reduce_op: str
    async_op: bool
    t_issue: float
    t_complete: float
    compute_before: float
    label: str
    op_id: int = -1
    splits: tuple = ()  # all_to_all_single: (input bytes per group rank, output bytes per group rank)
    payload: tuple[bytes, ...] = ()  # the inputs, when small enough to steer control flow (recorded_payload)


#: Inputs recorded in the trace so that a virtual rank contributes what the real one did: integer and
#: byte tensors up to this size (object collectives: pickles and their sizes) ...
PAYLOAD_INT_LIMIT = 64 * 1024
#: ... and floating-point ones up to this size (flags and scalars: found_inf, a loss sum, a norm).
PAYLOAD_FLOAT_LIMIT = 64
_INT_DTYPES = frozenset({"uint8", "int8", "int16", "int32", "int64", "bool", "uint16", "uint32", "uint64"})


def recorded_payload(ins: list) -> tuple[bytes, ...]:
    """The inputs' bytes when every input is inline and small enough to be data a program branches on
    (see the limits above); () otherwise. Kept as they came: the trace writer encodes them."""
    if not ins or any(d[0][0] != "i" for d in ins):
        return ()
    limit = PAYLOAD_INT_LIMIT if all(d[1] in _INT_DTYPES for d in ins) else PAYLOAD_FLOAT_LIMIT
    if sum(len(d[0][1]) for d in ins) > limit:
        return ()
    return tuple(d[0][1] for d in ins)


@dataclass
class Group:
    id: int
    name: str
    ranks: list[int]
    backend: str
    next_seq: list[int] = field(default_factory=list)
    pending: dict[int, list[Member | None]] = field(default_factory=dict)
    p2p: P2PQueues = field(default_factory=P2PQueues)
    p2p_seq: dict[tuple[int, int], int] = field(default_factory=dict)
    grank: dict[int, int] = field(default_factory=dict)  # global rank -> group rank (no list search per op)


@dataclass
class RankState:
    rank: int
    conn: Connection
    state: str = "starting"  # starting | queued | running | blocked | done
    holding: bool = False  # holds a compute slot now (granted at grant_t)
    clock: float = 0.0  # the rank's own compute clock (runtime work excluded), from its latest message
    last_op_clock: float = 0.0  # that clock at the rank's previous op
    grant_t: float = 0.0
    grant_slot: tuple[int, int] | None = None
    blocked_on: set[int] = field(default_factory=set)
    blocked_since: float = 0.0
    done_ids: set[int] = field(default_factory=set)
    pending: dict[int, OpRecord] = field(default_factory=dict)
    n_ops: int = 0
    exit_code: int | None = None
    runtime_s: dict | None = None  # the rank's runtime work in its slot turns (RankClient.runtime_s), at exit
    pid: int = 0


class Coordinator:
    def __init__(self, world_size: int, num_devices: int, slots_per_device: int, device_of: dict[int, int],
                 device_names: list[str], hang_timeout: float, authkey: bytes, host: str = "127.0.0.1") -> None:
        self.world_size = world_size
        self.hang_timeout = hang_timeout
        self.device_names = device_names
        self.listener = Listener((host, 0), authkey=authkey, backlog=min(world_size + 8, 4096))
        self.address = self.listener.address
        self.slots = SlotScheduler(num_devices, slots_per_device, device_of)
        self.t0 = time.perf_counter()
        self.ranks: dict[int, RankState] = {}
        self.conns: dict[Connection, RankState | None] = {}
        self.group_table = GroupTable()  # which group each rank's handle names (torch reuses names)
        self.groups_by_id: dict[int, Group] = {}
        self.n_finished = 0
        self.iterations_done = 0  # 'iteration' spans ended, summed over ranks (progress of a capture)
        self.iterations_ended: dict[int, int] = {}  # rank -> 'iteration' spans it ended
        self.predictor: Any = None  # f(trace_dir, iteration) -> (seconds | None, note); see set_predictor
        self.live_trace: Path | None = None
        self.predict_waiting: list[tuple[RankState, int]] = []
        self.paused_grants: list[Grant] | None = None  # grants held back while a prediction is computed
        self._last_progress = 0.0
        self.segments = SegmentMap()
        self.selector = selectors.DefaultSelector()
        self.memory: list[DeviceMemory] | None = None  # set when swapping is on (see enable_swap)
        self.times_gpu = False  # ranks time GPU segments: each is told when its timer may start (P.TIMING)
        # --swap auto with GPU timing: a device's ranks start the profiler only once timing_verdict allows
        self.timing_gated = False
        self.timing: dict[int, dict] = {}  # device -> {"on", "why"}: the verdicts given
        self._timing_waits: dict[int, set[int]] = {}  # device -> ranks yet to end iteration 1 (or exit)
        self._timing_ended: set[int] = set()  # devices where some rank ended iteration 1
        self.footprint_check: FootprintCheck | None = None  # NVML's figures for swapping ranks (runtime.nvml)
        self.awaiting_room: list[Grant] = []
        self.ops: list[OpRecord] = []
        self.marks: list[dict] = []
        self.gpu_rows: list[dict] = []  # per compute segment on a GPU: host and device times (gpu table)
        self.slot_log: list[dict] = []
        self.control: Connection | None = None
        self.last_progress = time.perf_counter()
        self.finished = False

    def enable_swap(self, swapper: Swapper, capacities: list[int], policy: str = "resident-first",
                    host_capacity: int | None = None, gate_timing: bool = False) -> None:
        """Keep at most each device's capacity of ranks' state resident, swapping blocked ranks out.

        With `resident-first`, the slot goes preferably to a queued rank whose state is on the device,
        which cuts swaps (bench: `python bench/swap_policy.py`); `fifo` keeps plain arrival order.
        ``host_capacity``: bytes of host memory the checkpointed state of all devices may take.
        ``gate_timing`` (--swap auto with GPU timing): ranks time their GPU segments only once their
        device's verdict allows it (see runtime.memory.DeviceMemory.timing_verdict).
        """
        self.timing_gated = gate_timing
        if gate_timing:
            for r in range(self.world_size):
                self._timing_waits.setdefault(self.slots.device_of(r), set()).add(r)
        host = HostBudget(host_capacity) if host_capacity is not None else None
        self.memory = [DeviceMemory(c, swapper, host=host) for c in capacities]
        if policy == "resident-first":
            mem = self.memory
            self.slots.policy = ResidentFirstPolicy(lambda r: r in mem[self.slots.device_of(r)].resident)

    def timing_verdicts(self) -> dict:
        """Per device name: whether GPU timing ran there under --swap auto, and why."""
        return {self.device_names[d]: v for d, v in sorted(self.timing.items())}

    def _decide_timing(self, rank: int, ended: bool) -> None:
        """``rank`` ended iteration 1 (``ended``) or exited: give its device's verdict once every rank
        on it has done one or the other, and one of them ended an iteration."""
        device = self.slots.device_of(rank)
        waits = self._timing_waits.get(device)  # None unless timing is gated
        if waits is None or device in self.timing:
            return
        waits.discard(rank)
        if ended:
            self._timing_ended.add(device)
        if waits or device not in self._timing_ended:
            return
        on, why = self.memory[device].timing_verdict()
        self.timing[device] = {"on": on, "why": why}
        print(f"prism: {self.device_names[device]}: {why}", file=sys.stderr, flush=True)
        for rs in self.ranks.values():
            if rs.state != "done" and self.slots.device_of(rs.rank) == device:
                self._send(rs, {"t": P.TIMING, "on": on, "why": why})

    def swap_stats(self) -> dict:
        if self.memory is None:
            return {}
        return {str(r): vars(s) for m in self.memory for r, s in sorted(m.stats.items()) if s.swaps_out or s.swaps_in}

    def now(self) -> float:
        return time.perf_counter() - self.t0

    # ---- main loop ---------------------------------------------------------------------------------
    def serve(self) -> None:
        # one selector for the whole run: re-registering every connection at each wait costs O(ranks)
        accept_sock = self.listener._listener._socket  # readable when a rank connects
        self.selector.register(accept_sock, selectors.EVENT_READ, None)
        while not self.finished:
            for key, _ in self.selector.select(timeout=0.2):
                conn = key.data
                if conn is None:
                    self._accept()
                    continue
                self._drain(conn)
                if self.finished:
                    break
            if self.awaiting_room:
                self._retry_room()
            self._check_hang()
        self.segments.close()

    def _drain(self, conn: Connection) -> None:
        """Handle every message already waiting on `conn`."""
        while conn in self.conns and not self.finished:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self._lost(conn)
                return
            self.last_progress = time.perf_counter()
            try:
                self._dispatch(conn, msg)
            except Exception:  # a bug or a malformed request must end the job with a report, not silently
                import traceback

                rank = getattr(self.conns.get(conn), "rank", "?")
                self._fatal("internal", f"prism coordinator: error while handling {msg.get('t')!r} from rank "
                            f"{rank}:\n{traceback.format_exc()}")
            try:
                if not conn.poll(0):
                    return
            except (EOFError, OSError):
                self._lost(conn)
                return

    def _accept(self) -> None:
        try:
            conn = self.listener.accept()
        except Exception as e:  # a stranger failing authentication must not stop the job
            print(f"prism coordinator: refused a connection: {e}", file=sys.stderr)
            return
        P.no_delay(conn)
        self.conns[conn] = None
        self.selector.register(conn, selectors.EVENT_READ, conn)

    def _lost(self, conn: Connection) -> None:
        rs = self.conns.pop(conn, None)
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        if rs is not None and rs.state != "done":
            # died without saying goodbye: the launcher reports the crash; stop scheduling it
            self._finish_rank(rs, None)
        if conn is self.control:
            self.finished = True  # the launcher is gone: nothing left to serve

    def _dispatch(self, conn: Connection, msg: dict) -> None:
        t = msg["t"]
        rs = self.conns.get(conn)
        if rs is not None and "clk" in msg:  # every message of a computing rank carries its clock
            rs.clock = msg["clk"]
        if t == P.HELLO:
            rs = RankState(msg["rank"], conn, pid=msg.get("pid", 0))
            self.ranks[rs.rank] = rs
            self.conns[conn] = rs
            if self.times_gpu and not self.timing_gated:  # nothing to wait for: its timer may start at once
                self._send(rs, {"t": P.TIMING, "on": True, "why": ""})
            self._progress()
        elif t == P.CONTROL:
            self.control = conn
        elif t == P.OP:
            self._on_op(rs, msg)
        elif t == P.BLOCK:
            self._note_memory(rs, msg)
            self._on_block(rs, msg["ids"])
            self._enforce_memory(rs.rank)
        elif t == P.ACQUIRE:
            rs.state = "queued"
            self._apply(self.slots.request(rs.rank))
        elif t == P.RELEASE:  # waits a duration it does not compute (RankClient.idle); ACQUIRE follows
            rs.state = "idle"  # not "blocked": a sleeping rank will move again, so it is no hang
            self._stop_holding(rs)
        elif t == P.GROUP:
            self._on_group(rs, msg)
        elif t == P.MARK:
            self.marks.append({"rank": rs.rank, "name": msg["name"], "phase": msg["phase"], "t": self.now(),
                               "compute_clock": rs.clock, "attrs": json.dumps(msg["attrs"])})
            if msg["name"] == "iteration" and msg["phase"] == "E":
                self.iterations_done += 1
                self.iterations_ended[rs.rank] = self.iterations_ended.get(rs.rank, 0) + 1
                if self.iterations_ended[rs.rank] == 1:
                    self._decide_timing(rs.rank, ended=True)
                if time.monotonic() - self._last_progress > 0.5:  # a progress line, not a message per mark
                    self._progress()
                self._answer_predictions()
        elif t == P.PREDICT:
            rs.state = "blocked"  # gives its slot back while every rank finishes the iteration
            rs.blocked_since = time.perf_counter()
            self._stop_holding(rs)
            self.predict_waiting.append((rs, int(msg["iteration"])))
            self._answer_predictions()
        elif t == P.GPUTIME:
            self.gpu_rows.extend(msg["rows"])
        elif t == P.DROP:
            self.segments.drop(msg["segment"])
        elif t == P.BYE:
            rs.runtime_s = msg.get("rt")
            self._finish_rank(rs, msg["exit_code"])
            try:
                conn.send({"t": P.BYE})
            except OSError:
                pass
        elif t == P.FINISH:
            self._on_finish(msg)

    # ---- slots -------------------------------------------------------------------------------------
    def _stop_holding(self, rs: RankState) -> None:
        if rs.holding:
            rs.holding = False
            d, s = rs.grant_slot
            self.slot_log.append({"rank": rs.rank, "device": self.device_names[d], "slot": s,
                                  "t_grant": rs.grant_t, "t_release": self.now(), "compute_clock": rs.clock})
        for g in self.slots.release(rs.rank):
            self._grant(g)
        if self.paused_grants is not None:
            self._answer_predictions()

    def _apply(self, grants: list[Grant]) -> None:
        for g in grants:
            self._grant(g)

    def _grant(self, g: Grant) -> None:
        if self.paused_grants is not None:  # a prediction waits for the slots to drain
            self.paused_grants.append(g)
            return
        if self.memory is not None and not self._make_resident(g):
            self.awaiting_room.append(g)  # holds the slot; retried when memory frees up
            return
        rs = self.ranks[g.rank]
        rs.state = "running"
        rs.holding, rs.grant_t = True, self.now()
        rs.grant_slot = (g.device, g.slot)
        self._send(rs, {"t": P.GRANT})

    # ---- memory (state preservation) --------------------------------------------------------------
    def _make_resident(self, g: Grant) -> bool:
        mem = self.memory[g.device]
        evictable = self._evictable(g.device, exclude=g.rank)
        pids = {r: rs.pid for r, rs in self.ranks.items()}
        try:
            return mem.make_resident(g.rank, evictable, pids, self._completes_last)
        except Exception as e:  # a failing checkpoint API is the job's end, with what to do
            self._fatal("swap", f"prism: swapping on {self.device_names[g.device]} failed: {e}")
            return False

    def _evictable(self, device: int, exclude: int = -1) -> list[int]:
        """Ranks on `device` not computing: blocked in an op, or queued for a slot (not yet granted)."""
        waiting_room = {g.rank for g in self.awaiting_room}
        return [r for r, rs in self.ranks.items() if rs.state in ("blocked", "queued") and r != exclude
                and r not in waiting_room and self.slots.device_of(r) == device]

    def _completes_last(self, rank: int) -> float:
        """Eviction preference: ranks whose pending collectives miss the most members wait longest."""
        rs = self.ranks[rank]
        missing = 0
        for op_id in rs.blocked_on:
            rec = rs.pending.get(op_id)
            if rec is None or rec.seq < 0:
                continue
            g = self.groups_by_id[rec.group]
            slot = g.pending.get(rec.seq)
            missing += sum(1 for m in slot if m is None) if slot else 0
        return missing

    def _retry_room(self) -> None:
        waiting, self.awaiting_room = self.awaiting_room, []
        for g in waiting:
            self._grant(g)

    def _note_memory(self, rs: RankState, msg: dict) -> None:
        if self.memory is not None and "mem" in msg:
            self.memory[self.slots.device_of(rs.rank)].report(rs.rank, int(msg["mem"]))

    def _check_footprints(self) -> None:
        """When a FootprintCheck sample is due, as a rank blocks: NVML's figure for every blocked,
        resident rank (its last report is current: it has not run since) replaces its report's."""
        held = self.footprint_check.sample() if self.footprint_check is not None else None
        if held is None:
            return
        for d, mem in enumerate(self.memory or []):
            for r in list(mem.resident):
                rs = self.ranks.get(r)
                if rs is not None and rs.state == "blocked" and rs.pid in held:
                    pair = mem.cross_check(r, held[rs.pid])
                    if pair is not None:
                        self.footprint_check.record(r, *pair, self.device_names[d])

    def _enforce_memory(self, rank: int) -> None:
        """After a rank blocked: if its device's residents outgrew it, swap out the longest waiters."""
        if self.memory is None:
            return
        self._check_footprints()
        d = self.slots.device_of(rank)
        evictable = self._evictable(d)
        try:
            self.memory[d].enforce(evictable, {r: rs.pid for r, rs in self.ranks.items()}, self._completes_last)
        except Exception as e:
            self._fatal("swap", f"prism: swapping on {self.device_names[d]} failed: {e}")

    def _on_block(self, rs: RankState, ids: list[int]) -> None:
        waiting = {i for i in ids if i not in rs.done_ids}
        rs.done_ids.difference_update(ids)
        if not waiting:
            self._send(rs, {"t": P.GRANT})  # already complete: keep the slot
            return
        rs.blocked_on = waiting
        rs.blocked_since = time.perf_counter()
        rs.state = "blocked"
        self._stop_holding(rs)

    def _op_completed(self, rs: RankState, op_id: int) -> None:
        rec = rs.pending.pop(op_id, None)
        if rec is not None:
            rec.t_complete = self.now()
        if op_id in rs.blocked_on:
            rs.blocked_on.discard(op_id)
            if not rs.blocked_on and rs.state == "blocked":
                rs.state = "queued"
                self._apply(self.slots.request(rs.rank))
        else:
            rs.done_ids.add(op_id)

    # ---- live prediction (Megatron's log line carries the predicted iteration time) ----------------
    def set_predictor(self, predictor: Any, live_trace: Path, options: dict | None = None) -> None:
        """``predictor(trace_dir, iteration, **options) -> (seconds | None, note)``, given by the launcher
        (the runtime knows no replay): it reads a snapshot of the trace so far, written to ``live_trace``."""
        self.predictor, self.live_trace, self.predictor_options = predictor, live_trace, options or {}

    def _answer_predictions(self) -> None:
        if not self.predict_waiting:
            return
        self.predict_waiting = [(rs, it) for rs, it in self.predict_waiting if rs.state != "done"]  # died waiting
        ready = [(rs, it) for rs, it in self.predict_waiting if len(self.ranks) == self.world_size and all(
            self.iterations_ended.get(r.rank, 0) >= it or r.state == "done" for r in self.ranks.values())]
        if not ready:
            return
        if any(r.state == "running" for r in self.ranks.values()):
            # the replay runs on this machine's cores: let the computing ranks block first and grant no
            # slot meanwhile, so it never inflates a rank's measured compute time
            if self.paused_grants is None:
                self.paused_grants = []
            return
        for rs, it in ready:
            seconds, note = None, "no predictor in this run"
            if self.predictor is not None:
                try:
                    from prism_megatron.runtime.trace_export import write_bare_trace

                    write_bare_trace(self, self.live_trace, {"live": True}, {})
                    seconds, note = self.predictor(self.live_trace, it, **self.predictor_options)
                except Exception as e:  # a failed prediction must not end the capture
                    seconds, note = None, f"prediction failed: {type(e).__name__}: {e}"
            self._send(rs, {"t": P.PREDICTED, "iteration": it, "seconds": seconds, "note": note})
            rs.state = "queued"
            self._apply(self.slots.request(rs.rank))
        self.predict_waiting = [w for w in self.predict_waiting if w not in ready]
        held, self.paused_grants = self.paused_grants or [], None
        self._apply(held)

    def _finish_rank(self, rs: RankState, exit_code: int | None) -> None:
        self._stop_holding(rs)
        if self.memory is not None:  # an ended process holds no device memory
            self.memory[self.slots.device_of(rs.rank)].forget(rs.rank)
            self._retry_room()
        rs.state = "done"
        rs.exit_code = exit_code
        self.n_finished += 1
        self._decide_timing(rs.rank, ended=False)
        self._answer_predictions()
        self._progress()

    def _progress(self) -> None:
        if self.control is not None:
            self._last_progress = time.monotonic()
            self._send_control({"t": P.PROGRESS, "connected": len(self.ranks), "finished": self.n_finished,
                                "iterations": self.iterations_done})

    # ---- ops -------------------------------------------------------------------------------------------
    def _on_group(self, rs: RankState, msg: dict) -> None:
        try:
            gid, new = self.group_table.declare(rs.rank, msg["h"], msg["name"], msg["ranks"], msg["world"])
        except GroupMismatch as e:
            return self._fatal("mismatch", str(e))
        if new:
            g = Group(gid, msg["name"], list(msg["ranks"]), msg["backend"])
            g.next_seq = [0] * len(g.ranks)
            g.grank = {r: i for i, r in enumerate(g.ranks)}
            self.groups_by_id[g.id] = g

    def _on_op(self, rs: RankState, msg: dict) -> None:
        for seg in msg.get("drops", ()):
            self.segments.drop(seg)
        g = self.groups_by_id[self.group_table.group_of(rs.rank, msg["g"])]
        grank = g.grank[rs.rank]
        for key in ("peer", "root"):
            v = msg.get(key)
            if v is not None and not 0 <= v < len(g.ranks):
                return self._fatal("mismatch", f"rank {rs.rank}: {msg['kind']} on group {g.name!r} (ranks "
                                   f"{_ranks(g.ranks)}) names {key} {v}, outside the group's {len(g.ranks)} ranks")
        now = self.now()
        kind = msg["kind"]
        peer = msg.get("peer")
        root = msg.get("root")
        nbytes = max(sum(desc_bytes(d[0]) for d in msg["ins"]), sum(desc_bytes(d[0]) for d in msg["outs"]))
        rec = OpRecord(
            rank=rs.rank, index=rs.n_ops, kind=kind, group=g.id, seq=-1,
            peer=g.ranks[peer] if peer is not None else -1, root=g.ranks[root] if root is not None else -1,
            bytes=nbytes, dtype=(msg["ins"] or msg["outs"] or [(None, "", [])])[0][1],
            shapes=json.dumps([d[2] for d in msg["ins"] + msg["outs"]]), reduce_op=msg.get("redop") or "",
            async_op=bool(msg.get("async_op")), t_issue=now, t_complete=float("nan"),
            compute_before=rs.clock - rs.last_op_clock, label=msg.get("label") or "", op_id=msg["id"],
            splits=(msg["in_splits"], msg["out_splits"]) if "in_splits" in msg else (),
            payload=recorded_payload(msg["ins"]),
        )
        rs.last_op_clock = rs.clock
        rs.n_ops += 1
        rs.pending[msg["id"]] = rec
        self.ops.append(rec)
        m = Member(rs.rank, grank, msg, rec)
        if kind == "send":
            if peer == grank:
                return self._fatal("mismatch", f"rank {rs.rank} sends to itself on group {g.name!r}")
            self._p2p_seq(g, rec, grank, peer)
            match = g.p2p.add_send(m)
        elif kind == "recv":
            if peer is not None:
                self._p2p_seq(g, rec, peer, grank)
            match = g.p2p.add_recv(m)
        else:
            match = None
            seq = g.next_seq[grank]
            g.next_seq[grank] += 1
            rec.seq = seq
            slot = g.pending.setdefault(seq, [None] * len(g.ranks))
            slot[grank] = m
            if all(x is not None for x in slot):
                del g.pending[seq]
                self._run_collective(g, seq, slot)  # type: ignore[arg-type]
        if match is not None:
            self._run_p2p(g, *match)
        if msg.get("block"):  # a synchronous op: the rank waits for it right away
            self._note_memory(rs, msg)
            self._on_block(rs, [msg["id"]])
            self._enforce_memory(rs.rank)

    def _p2p_seq(self, g: Group, rec: OpRecord, src: int, dst: int) -> None:
        key = (src, dst, rec.kind)
        rec.seq = g.p2p_seq.get(key, 0)
        g.p2p_seq[key] = rec.seq + 1

    def _read(self, desc: tuple, dtype: str) -> torch.Tensor:
        if desc[0] == "i":
            raw = torch.frombuffer(bytearray(desc[1]), dtype=torch.uint8) if desc[1] else _EMPTY
        else:
            raw = self.segments.view(desc[1], desc[2], desc[3])
        return raw.view(P.dtype_from_name(dtype)) if raw.numel() else torch.empty(0, dtype=P.dtype_from_name(dtype))

    def _out_view(self, m: Member, j: int, like: torch.Tensor) -> torch.Tensor | None:
        """Member ``m``'s output ``j`` in shared memory, typed like ``like``, or None when it is inline,
        empty, or of another size or type."""
        desc, dt, _ = m.msg["outs"][j]
        if desc[0] != "s" or not like.numel() or P.dtype_from_name(dt) != like.dtype or desc[3] != like.nbytes:
            return None
        return self.segments.view(desc[1], desc[2], desc[3]).view(like.dtype)

    def _deliver(self, m: Member, outs: list[torch.Tensor | None], src: int = -1) -> None:
        """Write `outs` (flat tensors, one per output of m) and tell the rank."""
        inline: list[bytes | None] = []
        for (desc, _dt, _shape), t in zip(m.msg["outs"], outs, strict=True):
            if desc[0] == "l":  # the rank wrote it (a group of one)
                inline.append(None)
                continue
            raw = t.reshape(-1).view(torch.uint8) if t is not None and t.numel() else None
            want = desc_bytes(desc)
            got = 0 if raw is None else raw.numel()
            if got != want:
                raise RuntimeError(f"internal: rank {m.rank} {m.kind} output of {got} bytes, expected {want}")
            if desc[0] == "s":
                if raw is not None:
                    dst = self.segments.view(desc[1], desc[2], desc[3])
                    if dst.data_ptr() != raw.data_ptr():  # not already written there (_out_view)
                        dst.copy_(raw)
                inline.append(None)
            else:
                inline.append(raw.numpy().tobytes() if raw is not None else b"")
        rs = self.ranks[m.rank]
        self._send(rs, {"t": P.DONE, "id": m.msg["id"], "out": inline, "src": src})
        self._op_completed(rs, m.msg["id"])

    def _run_collective(self, g: Group, seq: int, ms: list[Member]) -> None:
        problem = check_collective(ms)
        if problem is not None:
            return self._fatal("mismatch", f"collective #{seq} on group {g.name!r} (ranks {_ranks(g.ranks)}): "
                               f"{problem}")
        kind = ms[0].kind
        n = len(ms)
        if n == 1 and ms[0].msg.get("local"):  # a group of one: the rank computed its result (_local_result)
            return self._deliver(ms[0], [None] * len(ms[0].msg["outs"]))
        ins = [[self._read(d[0], d[1]) for d in m.msg["ins"]] for m in ms]
        redop, factor = ms[0].msg.get("redop"), ms[0].msg.get("factor")
        root = ms[0].msg.get("root")
        outs: list[list[torch.Tensor | None]]
        if kind == "all_reduce":  # into the first member's output, copied from there to the others
            rs_ = [C.reduce([ins[i][j] for i in range(n)], redop, factor, out=self._out_view(ms[0], j, ins[0][j]))
                   for j in range(len(ins[0]))]
            outs = [rs_ for _ in ms]
        elif kind == "reduce":
            r = [C.reduce([ins[i][j] for i in range(n)], redop, factor) for j in range(len(ins[0]))]
            outs = [r if i == root else [] for i in range(n)]
        elif kind == "broadcast":
            outs = [[] if i == root else [ins[root][0]] for i in range(n)]
        elif kind == "all_gather":
            r = [torch.cat([ins[i][j].view(torch.uint8) for i in range(n)]) for j in range(len(ins[0]))]
            outs = [r for _ in ms]
        elif kind == "all_gather_list":
            outs = [[ins[i][0] for i in range(n)] for _ in ms]
        elif kind == "reduce_scatter":
            chunks = [C.reduce_scatter([ins[i][j] for i in range(n)], redop, factor) for j in range(len(ins[0]))]
            outs = [[c[i] for c in chunks] for i in range(n)]
        elif kind == "reduce_scatter_list":
            outs = [[r] for r in C.reduce_scatter_lists(ins, redop, factor)]
        elif kind == "gather":
            outs = [[ins[i][0] for i in range(n)] if j == root else [] for j in range(n)]
        elif kind == "scatter":
            outs = [[ins[root][j]] for j in range(n)]
        elif kind == "all_to_all_list":
            outs = [[ins[i][j] for i in range(n)] for j in range(n)]
        elif kind == "all_to_all":
            pieces = []
            for i, m in enumerate(ms):
                raw = ins[i][0].reshape(-1).view(torch.uint8) if ins[i][0].numel() else _EMPTY
                pieces.append(list(raw.split(m.msg["in_splits"])))
            outs = [[torch.cat([pieces[i][j] for i in range(n)])] for j in range(n)]
        elif kind == "barrier":
            outs = [[] for _ in ms]
        else:
            return self._fatal("unsupported", f"rank {ms[0].rank}: op {kind!r} is not supported by prism")
        for m, o in zip(ms, outs, strict=True):
            self._deliver(m, [t.reshape(-1) if t is not None else None for t in o])

    def _run_p2p(self, g: Group, send: Member, recv: Member) -> None:
        problem = check_p2p(send, recv)
        if problem is not None:
            return self._fatal("mismatch", f"group {g.name!r} (ranks {_ranks(g.ranks)}): {problem}")
        if recv.record.seq < 0:  # a receive from any source learns its peer now
            recv.record.peer = send.rank
            self._p2p_seq(g, recv.record, send.grank, recv.grank)
        data = self._read(send.msg["ins"][0][0], send.msg["ins"][0][1])
        self._deliver(recv, [data.reshape(-1)], src=send.grank)
        self._deliver(send, [])

    # ---- failure and hangs -------------------------------------------------------------------------
    def _check_hang(self) -> None:
        if time.perf_counter() - self.last_progress < self.hang_timeout:
            return  # a message came in recently: no need to look at every rank (this runs every loop turn)
        live = [r for r in self.ranks.values() if r.state != "done"]
        if len(self.ranks) < self.world_size:
            return  # ranks still starting may yet post the missing ops
        stuck_on_memory = bool(self.awaiting_room) and not any(r.state == "running" for r in live)
        if not live or (any(r.state != "blocked" for r in live) and not stuck_on_memory):
            return
        stalled = time.perf_counter() - max(self.last_progress, max(r.blocked_since for r in live))
        if stalled < self.hang_timeout:
            return
        report = format_hang_report(self, stalled)
        self._fatal("hang", report)

    def _fatal(self, kind: str, report: str) -> None:
        self._send_control({"t": P.FATAL, "kind": kind, "report": report})
        self.finished = self.control is None
        if self.control is None:
            print(report, file=sys.stderr)

    def _send(self, rs: RankState, msg: dict) -> None:
        try:
            rs.conn.send(msg)
        except OSError:
            pass  # the rank is gone; the launcher reports it

    def _send_control(self, msg: dict) -> None:
        if self.control is not None:
            try:
                self.control.send(msg)
            except OSError:
                self.finished = True

    # ---- the end: the trace ----------------------------------------------------------------------
    def _on_finish(self, msg: dict) -> None:
        path = None
        if msg.get("status") in ("ok", "oom") and msg.get("trace_dir"):  # an OOM is a prediction: keep it
            from prism_megatron.runtime.trace_export import write_bare_trace

            path = str(write_bare_trace(self, Path(msg["trace_dir"]), msg.get("job", {}), msg.get("exit_codes", {})))
        self._send_control({"t": P.WRITTEN, "path": path})
        self.finished = True


_EMPTY = torch.empty(0, dtype=torch.uint8)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 8:
        return f"{ranks[:4]}...{ranks[-2:]} ({len(ranks)} ranks)".replace("]...[", ", ..., ")
    return str(ranks)


def main(argv: list[str] | None = None) -> None:
    """Entry of the sidecar process: `python -m prism_megatron.runtime.coordinator CONFIG_JSON`.

    Prints one JSON line {"address": [host, port], "store_port": port} once it listens.
    """
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    cfg = json.loads(ap.parse_args(argv).config)
    authkey = bytes.fromhex(os.environ.pop("PRISM_AUTHKEY"))
    torch.set_num_threads(max(1, int(cfg.get("threads", 1))))
    coord = Coordinator(
        world_size=cfg["world_size"], num_devices=len(cfg["devices"]), slots_per_device=cfg["slots_per_device"],
        device_of={int(k): v for k, v in cfg["device_of"].items()}, device_names=cfg["devices"],
        hang_timeout=cfg["hang_timeout"], authkey=authkey, host=cfg.get("host", "127.0.0.1"),
    )
    coord.times_gpu = bool(cfg.get("gpu_timing"))
    notes = []  # said by the launcher
    swap = cfg.get("swap", "none")
    if swap != "none":
        caps = [int(c) for c in cfg["device_memory"]]
        try:
            swapper = BudgetSwapper(caps[0]) if cfg.get("swapper") == "budget" else CudaCheckpointSwapper()
        except SwapUnavailable as e:
            if swap != "auto":
                raise
            swapper = None
            notes.append(f"--swap auto: ranks share each GPU without swaps ({e})")
        if swapper is not None and cfg.get("swapper") != "budget":
            try:
                coord.footprint_check = FootprintCheck(nvml_process_memory())
            except NvmlUnavailable as e:
                notes.append(f"ranks' GPU footprints are not cross-checked with NVML ({e}): swaps plan with "
                             "allocator reserved + a context estimate")
        if swapper is not None:
            coord.enable_swap(swapper, caps, cfg.get("swap_policy", "resident-first"), cfg.get("host_memory"),
                              gate_timing=swap == "auto" and coord.times_gpu)
    if cfg.get("predictor"):
        module, _, func = cfg["predictor"].partition(":")
        coord.set_predictor(getattr(importlib.import_module(module), func), Path(cfg["live_trace"]),
                            cfg.get("predictor_options"))
    from torch.distributed import TCPStore

    store = TCPStore(cfg.get("host", "127.0.0.1"), 0, cfg["world_size"], is_master=True, wait_for_workers=False,
                     multi_tenant=False)
    print(json.dumps({"address": list(coord.address), "store_port": store.port, "notes": notes}), flush=True)
    coord.serve()
    del store


if __name__ == "__main__":
    main()
