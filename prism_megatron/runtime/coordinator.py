"""The coordinator: one sidecar process per job (started by runtime.sidecar) that every logical rank
talks to. It matches ops by (group, sequence number), checks that members agree, performs the op on
host memory in a fixed order and returns results, and writes the PrismTrace when the job ends.
Single-threaded: every decision happens in one loop, in arrival order. This class routes events
between its parts, each with one job: groups and sequencing (runtime.groups), a folded job's virtual
members (runtime.folding), the data plane (runtime.dataplane), slot grants (runtime.grants), the
memory governor (runtime.governor), the recorder (runtime.recorder), the live predictor
(runtime.predictor), the hang detector (runtime.hang) and the launcher watch (runtime.watch).
"""

from __future__ import annotations

import heapq
import selectors
import sys
import time
from multiprocessing.connection import Connection, Listener
from pathlib import Path

import torch

from nccl_prune import PruneError
from prism_megatron.ops import OPS, CollectiveCall
from prism_megatron.runtime import protocol as P
from prism_megatron.runtime.dataplane import DataPlane
from prism_megatron.runtime.folding import Folding
from prism_megatron.runtime.governor import MemoryGovernor
from prism_megatron.runtime.grants import SlotGrants
from prism_megatron.runtime.groups import Group, GroupMismatch, GroupTable, fmt_ranks
from prism_megatron.runtime.hang import HangDetector, format_hang_report, format_stall_report, waits_on_exited
from prism_megatron.runtime.matching import Member, check_collective, check_p2p
from prism_megatron.runtime.predictor import NO_LIVE_PREDICTION, LivePredictor
from prism_megatron.runtime.ranks import RankState, RankStatus
from prism_megatron.runtime.reaper import kill_rank
from prism_megatron.runtime.recorder import Recorder
from prism_megatron.runtime.shm import remove_job_segments
from prism_megatron.runtime.slots import SlotScheduler
from prism_megatron.runtime.watch import LauncherWatch


class Coordinator:
    def __init__(self, world_size: int, num_devices: int, slots_per_device: int, device_of: dict[int, int],
                 device_names: list[str], hang_timeout: float, authkey: bytes, host: str = "127.0.0.1",
                 fold: dict | None = None) -> None:
        self.world_size = world_size
        # a folded job (runtime.folding): only live ranks connect; everything that counts ranks counts them
        self.fold = Folding(fold) if fold is not None else None
        self.n_live = len(self.fold.live) if self.fold is not None else world_size
        self.device_names = device_names
        self.listener = Listener((host, 0), authkey=authkey, backlog=min(world_size + 8, 4096))
        self.address = self.listener.address
        self.slots = SlotScheduler(num_devices, slots_per_device, device_of)
        self.ranks: dict[int, RankState] = {}
        self.conns: dict[Connection, RankState | None] = {}
        self.groups = GroupTable()
        self.data = DataPlane()
        self.recorder = Recorder()
        self.governor = MemoryGovernor(self.n_live, self.ranks, self.slots, self.groups, device_names,
                                       fatal=lambda kind, report: self._fatal(kind, report),
                                       send=lambda rs, msg: self._send(rs, msg))
        self.grants = SlotGrants(self.slots, self.ranks, self.governor, self.recorder, device_names,
                                 send=lambda rs, msg: self._send(rs, msg))
        self.predictor = LivePredictor()
        self.hang = HangDetector(hang_timeout)
        self.n_finished = 0
        self._last_progress = 0.0
        self.selector = selectors.DefaultSelector()
        self.control: Connection | None = None
        self.finished = False
        # what the launcher said when it connected (trace directory, job description): enough to keep the
        # trace so far and clean up if the launcher dies without ending the job
        self.job, self.trace_dir = {}, None
        self._held: dict | None = None  # a FATAL raised before the launcher's CONTROL was read: sent with it
        self.segment_prefix = ""  # the job's shared-memory segments, removed if the launcher dies
        self.prefault = None  # the thread giving the host region for in-process swaps its pages (runtime.swap_space)
        self.watch = LauncherWatch()
        self._finish_received = False
        self._deadlines: list[tuple[float, int, int]] = []  # (time, rank, op id): process-group timeouts
        self._deferred: dict[Connection, list[dict]] = {}  # what ranks sent while the loop awaited a swap

    def write_trace(self, path: Path, job: dict, exit_codes: dict, incomplete: str | None = None,
                    durable: bool = True) -> Path:
        from prism_megatron.runtime.trace_export import write_bare_trace

        if self.fold is not None:
            job = {**job, "fold": self.fold.to_json()}
        if self.predictor.answered:  # what Megatron's log line said, for the report to check its own figures by
            job = {**job, "live_predictions": {str(k): v for k, v in sorted(self.predictor.answered.items())}}
        return write_bare_trace(path, job, exit_codes, world_size=self.world_size, recorder=self.recorder,
                                groups=self.groups, ranks=self.ranks, governor=self.governor,
                                device_name=lambda r: self.device_names[self.slots.device_of(r)],
                                live=self.fold.live if self.fold is not None else None, incomplete=incomplete,
                                durable=durable)

    # ---- main loop ---------------------------------------------------------------------------------
    def serve(self) -> None:
        # one selector for the whole run: re-registering every connection at each wait costs O(ranks)
        accept_sock = self.listener._listener._socket  # readable when a rank connects
        self.selector.register(accept_sock, selectors.EVENT_READ, None)
        while not self.finished:
            for conn in [c for c, held in self._deferred.items() if held]:
                self._drain(conn, waiting=False)
            for key, _ in self.selector.select(timeout=0.2):
                conn = key.data
                if conn is None:
                    self._accept()
                    continue
                self._drain(conn)
                if self.finished:
                    break
            if self.governor.awaiting_room:
                self.grants.retry_room()
            self._check_timeouts()
            self._check_hang()
            self._check_launcher()
        self.data.close()

    def _check_launcher(self) -> None:
        """The launcher died (parent-death signal, or a new parent) or never connected: end the job here."""
        why = None if self.finished else self.watch.reason_to_end(self.control is not None)
        if why is not None:
            self._abandon(why)

    def _abandon(self, reason: str) -> None:
        """End the job without its launcher: its ranks and their children (process groups), its shared
        memory; the trace so far, marked incomplete. Nothing of the job may outlive both."""
        self.finished = True
        if self._finish_received:
            return  # the launcher ended the job itself
        if self._held is not None:
            print(self._held["report"], file=sys.stderr)
        print(f"prism coordinator: {reason}; ending the job's ranks and removing its shared memory",
              file=sys.stderr, flush=True)
        for rs in self.ranks.values():
            kill_rank(rs.pid)
        if self.segment_prefix:
            remove_job_segments(self.segment_prefix)
        if self.trace_dir:
            try:
                path = self.write_trace(Path(self.trace_dir), {**self.job, "wall_time_s": self.recorder.now()},
                                        {str(rs.rank): rs.exit_code for rs in self.ranks.values()},
                                        incomplete=reason)
                print(f"prism coordinator: partial trace written to {path}", file=sys.stderr, flush=True)
            except Exception as e:  # noqa: BLE001 - said, and the job ends anyway
                print(f"prism coordinator: could not write the partial trace to {self.trace_dir}: {e}",
                      file=sys.stderr, flush=True)

    def _drain(self, conn: Connection, waiting: bool = True) -> None:
        """Handle every message already waiting on `conn` (first those kept while a swap was awaited;
        ``waiting``: the connection has something to read)."""
        while conn in self.conns and not self.finished:
            held = self._deferred.get(conn)
            if held:
                msg = held.pop(0)
            elif not waiting:
                return
            else:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._lost(conn)
                    return
            self.hang.progress()
            try:
                self._dispatch(conn, msg)
            except Exception:  # a bug or a malformed request must end the job with a report, not silently
                import traceback

                rank = getattr(self.conns.get(conn), "rank", "?")
                self._fatal("internal", f"prism coordinator: error while handling {msg.get('t')!r} from rank "
                            f"{rank}:\n{traceback.format_exc()}")
            if self._deferred.get(conn):
                continue
            try:
                if not waiting or not conn.poll(0):
                    return
            except (EOFError, OSError):
                self._lost(conn)
                return

    def exchange(self, rank: int, msg: dict, timeout: float = 3600.0) -> dict:
        """Send ``msg`` to a blocked rank and return its answer (P.SWAPPED: an in-process swap, whose
        swapper calls this from the loop); what else the rank sends meanwhile is kept, in order, for
        the loop. A rank that dies or stays silent for ``timeout`` seconds answers a failure."""
        rs = self.ranks[rank]
        held = self._deferred.setdefault(rs.conn, [])
        try:
            rs.conn.send(msg)
            deadline = time.monotonic() + timeout
            while True:
                if not rs.conn.poll(max(0.0, min(1.0, deadline - time.monotonic()))):
                    if time.monotonic() >= deadline:
                        return {"ok": False, "error": f"no answer in {timeout:.0f} s"}
                    continue
                reply = rs.conn.recv()
                if reply.get("t") == P.SWAPPED:
                    if reply.get("ok"):  # the loop stood still while the rank moved its state; a refusal
                        self.hang.progress()  # (no room yet) is no progress: retried, it must not hide a stall
                    return reply
                held.append(reply)
        except (EOFError, OSError) as e:
            return {"ok": False, "error": f"its connection closed ({e or type(e).__name__})"}

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
        if rs is not None and rs.state != RankStatus.DONE:
            # died without saying goodbye: the launcher reports the crash; stop scheduling it
            self._finish_rank(rs, None)
        if conn is self.control and not self._finish_received:
            self._abandon(self.watch.why_gone())

    def _dispatch(self, conn: Connection, msg: dict) -> None:
        t = msg["t"]
        rs = self.conns.get(conn)
        if rs is not None and "clk" in msg:  # every message of a computing rank carries its clock
            rs.clock = msg["clk"]
        if t == P.HELLO:
            rs = RankState(msg["rank"], conn, pid=msg.get("pid", 0))
            self.ranks[rs.rank] = rs
            self.conns[conn] = rs
            self.governor.hello(rs)
            self._progress()
        elif t == P.CONTROL:
            self.control = conn
            self.job, self.trace_dir = msg.get("job", {}), msg.get("trace_dir")
            if self._held is not None:
                self._send_control(self._held)
        elif t == P.EXITED:
            self._exited(int(msg["rank"]), msg["code"])
        elif t == P.OP:
            self._on_op(rs, msg)
        elif t == P.WAITED:
            self.recorder.waited(rs, msg["ids"])
        elif t == P.BLOCK:
            self._block(rs, msg, msg["ids"])
        elif t == P.ACQUIRE:
            self.grants.request(rs)
        elif t == P.RELEASE:  # waits a duration it does not compute (RankClient.idle); ACQUIRE follows
            self.governor.note(rs, msg)
            rs.state = RankStatus.IDLE
            self._stop_holding(rs)
        elif t == P.GROUP:
            try:
                gid, new = self.groups.declare(rs.rank, msg["h"], msg["name"], msg["ranks"], msg["world"],
                                               msg["backend"])
            except GroupMismatch as e:
                self._fatal("mismatch", str(e))
            else:
                if msg.get("timeout"):
                    rs.timeouts[gid] = float(msg["timeout"])
                if new and self.fold is not None and (problem := self.fold.fold_group(self.groups.by_id[gid])):
                    self._fatal("fold", problem)
        elif t == P.MARK:
            self.recorder.mark(rs, msg)
            self.governor.mark(rs.rank, msg)
            if msg["name"] == "iteration" and msg["phase"] == "E":
                if self.predictor.iteration_ended(rs.rank) == 1:
                    self.governor.decide_timing(rs.rank, ended=True)
                if time.monotonic() - self._last_progress > 0.5:  # a progress line, not a message per mark
                    self._progress()
                self._answer_predictions()
        elif t == P.PREDICT:
            self.governor.note(rs, msg)
            rs.state = RankStatus.BLOCKED  # gives its slot back while every rank finishes the iteration
            rs.blocked_since = time.perf_counter()
            self._stop_holding(rs)
            if self.predictor.predictor is None:  # nothing to replay: no reason to wait for the other ranks
                self._send(rs, {"t": P.PREDICTED, "iteration": int(msg["iteration"]), "seconds": None,
                                "note": NO_LIVE_PREDICTION})
                self.grants.request(rs)
            else:
                self.predictor.waiting.append((rs, int(msg["iteration"])))
                self._answer_predictions()
        elif t == P.GPUTIME:
            self.recorder.gpu_rows.extend(msg["rows"])
        elif t == P.DROP:
            self.data.drop(msg["segment"])
        elif t == P.BYE:
            rs.runtime_s = msg.get("rt")
            self._finish_rank(rs, msg["exit_code"])
            try:
                conn.send({"t": P.BYE})
            except OSError:
                pass
        elif t == P.FINISH:
            self._on_finish(msg)
        elif t == P.ROOM:  # the rank's allocation waits: blocked ranks go out, or it fails
            short = max(int(msg["nbytes"]) - int(msg.get("free", 0)), 1)
            self._send(rs, {"t": P.ROOM_MADE, "ok": self.governor.make_room(rs.rank, short)})
        elif t == P.DEVICE_OOM:  # the rank waits for the verdict, so the launcher has the report first
            report = self.governor.physical_oom(rs.rank, msg)
            self._fatal("device-oom", report)
            self._send(rs, {"t": P.VERDICT, "report": report})

    # ---- ranks: slots, blocking, completion, exit ---------------------------------------------------
    def _stop_holding(self, rs: RankState) -> None:
        self.grants.release(rs)
        if self.grants.paused is not None:
            self._answer_predictions()

    def _block(self, rs: RankState, msg: dict, ids: list[int]) -> None:
        """``rs`` waits for ops ``ids``: its slot goes to another rank until they complete."""
        self.governor.note(rs, msg)
        waiting = {i for i in ids if i not in rs.done_ids}
        rs.done_ids.difference_update(ids)
        if not waiting and self.governor.keep(rs.rank):
            self._send(rs, {"t": P.GRANT})  # already complete: keep the slot
        else:
            rs.blocked_on = waiting
            rs.blocked_since = time.perf_counter()
            rs.state = RankStatus.BLOCKED
            self._stop_holding(rs)
            if not waiting:  # its next turn needs more room than the device has free: it queues for it
                self.grants.request(rs)
            for i in waiting:  # the group's own timeout (init_process_group / new_group), as gloo applies it
                rec = rs.pending.get(i)
                timeout = rec is not None and rs.timeouts.get(rec.group)
                if timeout:
                    heapq.heappush(self._deadlines, (rec.t_issue + timeout, rs.rank, i))
        self.governor.enforce(rs.rank)

    def _check_timeouts(self) -> None:
        """Fail the waits that outlived their process group's timeout, in every waiting rank, as gloo does:
        the rank's wait raises (RuntimeError, gloo's message) and the rank runs again."""
        now = self.recorder.now()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rank, op_id = heapq.heappop(self._deadlines)
            rs = self.ranks.get(rank)
            if rs is None or rs.state != RankStatus.BLOCKED or op_id not in rs.blocked_on:
                continue
            rec = rs.pending[op_id]
            g = self.groups.by_id[rec.group]
            ms = int(rs.timeouts[g.id] * 1000)
            what = f"{rec.kind} #{rec.seq}" if rec.seq >= 0 else rec.kind
            self._send(rs, {"t": P.ERROR, "id": op_id, "timed_out": True, "message": (
                f"[prism: gloo transport] Timed out waiting {ms}ms for {rec.kind} operation to complete (rank "
                f"{rank}: {what} on group {g.name!r}, ranks {fmt_ranks(g.ranks)}{g.missing_note(rec)})")})
            rs.blocked_on.discard(op_id)
            if not rs.blocked_on:
                self.grants.request(rs)

    def _exited(self, rank: int, code: int) -> None:
        """The launcher saw ``rank``'s process end with ``code`` (the coordinator may not have: no goodbye)."""
        rs = self.ranks.get(rank)
        if rs is None:  # ended before it connected
            rs = self.ranks[rank] = RankState(rank, None)  # type: ignore[arg-type]
            self._finish_rank(rs, code)
        elif rs.state != RankStatus.DONE:
            self._finish_rank(rs, code)
        else:
            rs.exit_code = code

    def _op_completed(self, rs: RankState, op_id: int) -> None:
        self.recorder.completed(rs, op_id)
        if op_id in rs.blocked_on:
            rs.blocked_on.discard(op_id)
            if not rs.blocked_on and rs.state == RankStatus.BLOCKED:
                self.grants.request(rs)
        else:
            rs.done_ids.add(op_id)

    def _answer_predictions(self) -> None:
        if not self.predictor.waiting:
            return
        ready = self.predictor.ready(self.ranks, self.n_live)
        if not ready:
            return
        if any(r.state == RankStatus.RUNNING for r in self.ranks.values()):
            # the replay runs on this machine's cores: let the computing ranks block first and grant no
            # slot meanwhile, so it never inflates a rank's measured compute time
            self.grants.pause()
            return
        # the job keys that change what the graph is (a micro-batch fold: the target's micro-batches replayed)
        snapshot = {"live": True, **{k: self.job[k] for k in ("microbatches",) if k in self.job}}
        for rs, it in ready:
            # not flushed to the disk: the next logged iteration rewrites it (still swapped in whole)
            seconds, note = self.predictor.answer(it, lambda path: self.write_trace(
                path, snapshot, {}, incomplete="live snapshot of a running job", durable=False))
            self._send(rs, {"t": P.PREDICTED, "iteration": it, "seconds": seconds, "note": note})
            self.grants.request(rs)
        self.predictor.waiting = [w for w in self.predictor.waiting if w not in ready]
        self.grants.resume()

    def _finish_rank(self, rs: RankState, exit_code: int | None) -> None:
        self._stop_holding(rs)
        if self.governor.forget(rs.rank):
            self.grants.retry_room()
        rs.state = RankStatus.DONE
        rs.exit_code = exit_code
        self.n_finished += 1
        self.governor.decide_timing(rs.rank, ended=False)
        self._answer_predictions()
        self._progress()

    def _progress(self) -> None:
        if self.control is not None:
            self._last_progress = time.monotonic()
            self._send_control({"t": P.PROGRESS, "connected": len(self.ranks), "finished": self.n_finished,
                                "iterations": self.predictor.iterations_done})

    # ---- ops -------------------------------------------------------------------------------------------
    def _on_op(self, rs: RankState, msg: dict) -> None:
        if (gone := self.data.arrived(rs.rank, msg)) is not None:  # a segment it names was removed meanwhile
            return self._fatal("staging", gone)
        g = self.groups.of(rs.rank, msg["g"])
        grank = g.grank[rs.rank]
        for key in ("peer", "root"):
            v = msg.get(key)
            if v is not None and not 0 <= v < len(g.ranks):
                return self._fatal("mismatch", f"rank {rs.rank}: {msg['kind']} on group {g.name!r} (ranks "
                                   f"{fmt_ranks(g.ranks)}) names {key} {v}, outside the group's {len(g.ranks)} ranks")
        kind, peer, match = msg["kind"], msg.get("peer"), None
        rec = self.recorder.op(rs, g, msg)
        m = Member(rs.rank, grank, msg, rec)
        if self.fold is not None and self.fold.virtual_peer(g, msg):  # passed through (runtime.passthrough)
            problem = self.fold.pass_through(g, m, self.data, self._deliver)
            if problem is not None:
                return self._fatal("fold", f"rank {rs.rank}: {kind} on group {g.name!r}: {problem}")
        elif kind == "send":
            if peer == grank:
                return self._fatal("mismatch", f"rank {rs.rank} sends to itself on group {g.name!r}")
            self.groups.p2p_seq(g, rec, grank, peer)
            match = g.p2p.add_send(m)
        elif kind == "recv":
            if peer is not None:
                self.groups.p2p_seq(g, rec, peer, grank)
            match = g.p2p.add_recv(m)
        else:
            members = self.groups.post_collective(g, m)
            if members is not None:
                self._run_collective(g, rec.seq, members)
        if match is not None:
            self._run_p2p(g, *match)
        if msg.get("block"):  # a synchronous op: the rank waits for it right away
            self._block(rs, msg, [msg["id"]])

    def _deliver(self, m: Member, outs: list[torch.Tensor | None], src: int = -1) -> None:
        """Write `outs` (flat tensors, one per output of m) and tell the rank."""
        self._tell(m, self.data.write(m, outs), src)

    def _tell(self, m: Member, inline: list[bytes | None], src: int = -1) -> None:
        """Tell member ``m`` its op is done (its results written). From then on the rank may free its staging
        memory and stage its next op there."""
        rs = self.ranks[m.rank]
        self._send(rs, {"t": P.DONE, "id": m.msg["id"], "out": inline, "src": src})
        self._op_completed(rs, m.msg["id"])

    def _run_collective(self, g: Group, seq: int, ms: list[Member]) -> None:
        problem = check_collective(ms, None if g.fold is None else len(g.ranks))
        if problem is not None:
            return self._fatal("mismatch", f"collective #{seq} on group {g.name!r} (ranks {fmt_ranks(g.ranks)}): "
                               f"{problem}")
        op = OPS.get(ms[0].kind)
        if op is None or op.p2p:
            return self._fatal("unsupported", f"rank {ms[0].rank}: op {ms[0].kind!r} is not supported by prism")
        if len(ms) == 1 and ms[0].msg.get("local"):  # the rank computed its result (OpKind.local, local_fold)
            if g.fold is not None and (problem := self.fold.answered_in_rank(g, ms[0].msg)) is not None:
                return self._fatal("fold", f"rank {ms[0].rank}: collective #{seq} {ms[0].kind} on group "
                                   f"{g.name!r} (ranks {fmt_ranks(g.ranks)}): {problem}")
            if ms[0].msg.get("settled"):  # the rank went on (local_fold.SETTLED_RULE): nothing to tell it
                return self.recorder.completed(self.ranks[ms[0].rank], ms[0].msg["id"])
            return self._deliver(ms[0], [None] * len(ms[0].msg["outs"]))
        first = ms[0].msg
        call = CollectiveCall(
            ins=[self.data.inputs(m) for m in ms], redop=first.get("redop"), factor=first.get("factor"),
            root=first.get("root"), in_splits=[m.msg["in_splits"] for m in ms] if "in_splits" in first else None,
            out_view=lambda i, j, like: self.data.out_view(ms[i], j, like))
        answer = None
        if g.fold is not None:  # virtual members: answered by nccl_prune from the live members (ms)
            call.fold = g.fold
            call.in_place = bool(first.get("in_place"))
            if any("cur" in m.msg for m in ms):
                call.current = [[self.data.read(d[0], d[1]) for d in m.msg.get("cur", ())] for m in ms]
            if ms[0].kind == "broadcast" and len(ms) == 1 and first["outs"]:  # a serial capture's receiver
                answer, problem = self.fold.broadcast_answer(g, seq, call.root, first["outs"][0])
                if problem is not None:
                    return self._fatal("fold", f"rank {ms[0].rank}: collective #{seq} broadcast on group "
                                       f"{g.name!r} (ranks {fmt_ranks(g.ranks)}): {problem}")
            elif len(ms) == 1 and self.fold.class_rep is not None:  # a serial capture: RECORDED_REDUCTION_RULE
                call.recorded, problem = self.fold.reduction(g, seq, ms[0].kind, call.ins[0])
                if problem is not None:
                    return self._fatal("fold", f"rank {ms[0].rank}: collective #{seq} {ms[0].kind} on group "
                                       f"{g.name!r} (ranks {fmt_ranks(g.ranks)}): {problem}")
            recorded = (call.root,) if answer is not None else tuple(sorted(call.recorded or ()))
            self.fold.count(g, ms[0].kind, call.root, bool(first.get("in_place")), recorded=recorded)
        try:
            outs = [[answer]] if answer is not None else op.run(call)
        except PruneError as e:
            return self._fatal("fold", f"collective #{seq} {ms[0].kind} on group {g.name!r} "
                               f"(ranks {fmt_ranks(g.ranks)}): {e}")
        if g.fold is not None and ms[0].kind == "broadcast" and len(ms) == 1:  # kept for later captures
            sent = call.ins[0][0] if not first["outs"] else outs[0][0]
            self.fold.record_broadcast(g, seq, call.root, sent, (first["ins"] or first["outs"])[0][1])
        # every member's results are written before any member is told: a result may lie in a member's staging
        # memory (an all-reduce is computed into the first member's output, broadcast data is the root's input),
        # which that member reuses for its next op as soon as it is told
        inline = [self.data.write(m, [t.reshape(-1) if t is not None else None for t in o])
                  for m, o in zip(ms, outs, strict=True)]
        for m, x in zip(ms, inline, strict=True):
            self._tell(m, x)

    def _run_p2p(self, g: Group, send: Member, recv: Member) -> None:
        problem = check_p2p(send, recv)
        if problem is not None:
            return self._fatal("mismatch", f"group {g.name!r} (ranks {fmt_ranks(g.ranks)}): {problem}")
        if recv.record.seq < 0:  # a receive from any source learns its peer now
            recv.record.peer = send.rank
            self.groups.p2p_seq(g, recv.record, send.grank, recv.grank)
        data = self.data.read(send.msg["ins"][0][0], send.msg["ins"][0][1])
        self._deliver(recv, [data.reshape(-1)], src=send.grank)
        self._deliver(send, [])

    # ---- failure and hangs -------------------------------------------------------------------------
    def _check_hang(self) -> None:
        if self.finished:
            return
        stalled = self.hang.stalled(self.ranks, self.n_live, bool(self.governor.awaiting_room),
                                    lambda: waits_on_exited(self.ranks, self.groups))
        if stalled is not None:
            self._fatal("hang", format_hang_report(self.ranks, self.groups, self.governor, stalled))
            return
        holdouts = self.hang.holdouts(self.ranks, self.world_size)
        if holdouts:
            self._fatal("stall", format_stall_report(self.ranks, self.groups, self.governor, holdouts,
                                                     self.hang.timeout, self.recorder.now()))

    def _fatal(self, kind: str, report: str) -> None:
        """Hand the report to the launcher, which ends the job. The launcher sends CONTROL before it starts
        the ranks, but a rank's message may be read first: the report waits for it (or for the watch's
        deadline on a launcher that never connects, when _abandon prints it)."""
        self._send_control({"t": P.FATAL, "kind": kind, "report": report})
        if self.control is None:
            self._held = self._held or {"t": P.FATAL, "kind": kind, "report": report}
        self.hang.reported()  # the launcher ends the job; do not repeat the report meanwhile

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
        """Write the trace: complete for a job that ended normally (an OOM is a prediction: complete too),
        else the trace so far marked incomplete; a write that fails is said at once, with why."""
        self._finish_received, path, error = True, None, None
        if self.fold is not None:
            self.fold.finish()
        job, status = msg.get("job", {}), msg.get("status")
        incomplete = msg.get("incomplete")
        if status in MEMORY_FAILURES:  # the trace so far, beside the report that says why
            job = {**job, "end": {"status": status, "complete": False, "report": f"{status}-report.txt"}}
            incomplete = incomplete or f"{status}: see {status}-report.txt"
        if msg.get("trace_dir"):
            try:
                path = str(self.write_trace(Path(msg["trace_dir"]), job, msg.get("exit_codes", {}),
                                            incomplete=incomplete))
            except Exception as e:  # noqa: BLE001 - a full disk, a directory that is not a trace: said
                error = f"{type(e).__name__}: {e}"
        self._send_control({"t": P.WRITTEN, "path": path, "error": error, "note": self.governor.unmarked_swaps_note()})
        self.finished = True


#: Ends of a job in the memory paths that still write the trace so far (kinds of their FATAL reports).
MEMORY_FAILURES = ("device-oom", "swap")
