"""The coordinator: one sidecar process per job that every logical rank talks to.

It matches ops by (group, sequence number), checks that members agree, performs the op on host
memory in a fixed order, and returns results; it owns the slot scheduler, notices when no rank can
make progress (hang report), hosts the job's TCPStore (as torchrun's agent does, so ranks
rendezvous whatever order they start in), and writes the PrismTrace when the launcher says the
job ended. Single-threaded: every decision happens in one loop, in arrival order.

This class routes events between its parts, each with one job: the group table and sequencing
(runtime.groups), the data plane (runtime.dataplane), slot grants (runtime.grants), the memory
governor (runtime.governor), the recorder (runtime.recorder), the live predictor
(runtime.predictor) and the hang detector (runtime.hang).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
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
from prism_megatron.runtime.fake_device import FakeDevice
from prism_megatron.runtime.folding import Folding
from prism_megatron.runtime.governor import ADMISSION_MARGIN, MemoryGovernor, SwapMode, SwapPolicy
from prism_megatron.runtime.grants import SlotGrants
from prism_megatron.runtime.groups import Group, GroupMismatch, GroupTable
from prism_megatron.runtime.hang import HangDetector, format_hang_report
from prism_megatron.runtime.matching import Member, check_collective, check_p2p
from prism_megatron.runtime.nvml import FootprintCheck, NvmlUnavailable, nvml_process_memory
from prism_megatron.runtime.predictor import LivePredictor
from prism_megatron.runtime.ranks import RankState, RankStatus
from prism_megatron.runtime.recorder import Recorder
from prism_megatron.runtime.slots import SlotScheduler
from prism_megatron.runtime.swap import BudgetSwapper, CudaCheckpointSwapper, SwapUnavailable


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

    def write_trace(self, path: Path, job: dict, exit_codes: dict) -> Path:
        from prism_megatron.runtime.trace_export import write_bare_trace

        if self.fold is not None:
            job = {**job, "fold": self.fold.to_json()}
        return write_bare_trace(path, job, exit_codes, world_size=self.world_size, recorder=self.recorder,
                                groups=self.groups, ranks=self.ranks, governor=self.governor,
                                device_name=lambda r: self.device_names[self.slots.device_of(r)],
                                live=self.fold.live if self.fold is not None else None)

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
            if self.governor.awaiting_room:
                self.grants.retry_room()
            self._check_hang()
        self.data.close()

    def _drain(self, conn: Connection) -> None:
        """Handle every message already waiting on `conn`."""
        while conn in self.conns and not self.finished:
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
        if rs is not None and rs.state != RankStatus.DONE:
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
            self.governor.hello(rs)
            self._progress()
        elif t == P.CONTROL:
            self.control = conn
        elif t == P.OP:
            self._on_op(rs, msg)
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
                if new and self.fold is not None:
                    problem = self.fold.fold_group(self.groups.by_id[gid])
                    if problem is not None:
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
        self.governor.enforce(rs.rank)

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
        for rs, it in ready:
            seconds, note = self.predictor.answer(it, lambda path: self.write_trace(path, {"live": True}, {}))
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
        for seg in msg.get("drops", ()):
            self.data.drop(seg)
        g = self.groups.of(rs.rank, msg["g"])
        grank = g.grank[rs.rank]
        for key in ("peer", "root"):
            v = msg.get(key)
            if v is not None and not 0 <= v < len(g.ranks):
                return self._fatal("mismatch", f"rank {rs.rank}: {msg['kind']} on group {g.name!r} (ranks "
                                   f"{_ranks(g.ranks)}) names {key} {v}, outside the group's {len(g.ranks)} ranks")
        kind, peer = msg["kind"], msg.get("peer")
        rec = self.recorder.op(rs, g, msg)
        m = Member(rs.rank, grank, msg, rec)
        if kind in ("send", "recv") and g.fold is not None and peer is not None:
            problem = self.fold.check_p2p(g, grank if kind == "send" else peer, peer if kind == "send" else grank)
            if problem is not None:
                return self._fatal("fold", f"rank {rs.rank}: {kind} on group {g.name!r}: {problem}")
        if kind == "send":
            if peer == grank:
                return self._fatal("mismatch", f"rank {rs.rank} sends to itself on group {g.name!r}")
            self.groups.p2p_seq(g, rec, grank, peer)
            match = g.p2p.add_send(m)
        elif kind == "recv":
            if peer is not None:
                self.groups.p2p_seq(g, rec, peer, grank)
            match = g.p2p.add_recv(m)
        else:
            match = None
            members = self.groups.post_collective(g, m)
            if members is not None:
                self._run_collective(g, rec.seq, members)
        if match is not None:
            self._run_p2p(g, *match)
        if msg.get("block"):  # a synchronous op: the rank waits for it right away
            self._block(rs, msg, [msg["id"]])

    def _deliver(self, m: Member, outs: list[torch.Tensor | None], src: int = -1) -> None:
        """Write `outs` (flat tensors, one per output of m) and tell the rank."""
        inline = self.data.write(m, outs)
        rs = self.ranks[m.rank]
        self._send(rs, {"t": P.DONE, "id": m.msg["id"], "out": inline, "src": src})
        self._op_completed(rs, m.msg["id"])

    def _run_collective(self, g: Group, seq: int, ms: list[Member]) -> None:
        problem = check_collective(ms, None if g.fold is None else len(g.ranks))
        if problem is not None:
            return self._fatal("mismatch", f"collective #{seq} on group {g.name!r} (ranks {_ranks(g.ranks)}): "
                               f"{problem}")
        op = OPS.get(ms[0].kind)
        if op is None or op.p2p:
            return self._fatal("unsupported", f"rank {ms[0].rank}: op {ms[0].kind!r} is not supported by prism")
        if len(ms) == 1 and ms[0].msg.get("local"):  # a group of one: the rank computed its result (OpKind.local)
            return self._deliver(ms[0], [None] * len(ms[0].msg["outs"]))
        first = ms[0].msg
        call = CollectiveCall(
            ins=[self.data.inputs(m) for m in ms], redop=first.get("redop"), factor=first.get("factor"),
            root=first.get("root"), in_splits=[m.msg["in_splits"] for m in ms] if "in_splits" in first else None,
            out_view=lambda i, j, like: self.data.out_view(ms[i], j, like))
        if g.fold is not None:  # virtual members: answered by nccl_prune from the live members (ms)
            call.fold = g.fold
            call.in_place = bool(first.get("in_place"))
            if any("cur" in m.msg for m in ms):
                call.current = [[self.data.read(d[0], d[1]) for d in m.msg.get("cur", ())] for m in ms]
            self.fold.count(g, ms[0].kind, call.root, bool(first.get("in_place")))
        try:
            outs = op.run(call)
        except PruneError as e:
            return self._fatal("fold", f"collective #{seq} {ms[0].kind} on group {g.name!r} "
                               f"(ranks {_ranks(g.ranks)}): {e}")
        for m, o in zip(ms, outs, strict=True):
            self._deliver(m, [t.reshape(-1) if t is not None else None for t in o])

    def _run_p2p(self, g: Group, send: Member, recv: Member) -> None:
        problem = check_p2p(send, recv)
        if problem is not None:
            return self._fatal("mismatch", f"group {g.name!r} (ranks {_ranks(g.ranks)}): {problem}")
        if recv.record.seq < 0:  # a receive from any source learns its peer now
            recv.record.peer = send.rank
            self.groups.p2p_seq(g, recv.record, send.grank, recv.grank)
        data = self.data.read(send.msg["ins"][0][0], send.msg["ins"][0][1])
        self._deliver(recv, [data.reshape(-1)], src=send.grank)
        self._deliver(send, [])

    # ---- failure and hangs -------------------------------------------------------------------------
    def _check_hang(self) -> None:
        stalled = self.hang.stalled(self.ranks, self.n_live, bool(self.governor.awaiting_room))
        if stalled is not None:
            self._fatal("hang", format_hang_report(self.ranks, self.groups, self.governor, stalled))

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
        job, status = msg.get("job", {}), msg.get("status")
        if status in MEMORY_FAILURES:  # the trace so far, marked incomplete, beside the report that says why
            job = {**job, "end": {"status": status, "complete": False, "report": f"{status}-report.txt"}}
        if (status in ("ok", "oom") or status in MEMORY_FAILURES) and msg.get("trace_dir"):  # an OOM is a prediction
            path = str(self.write_trace(Path(msg["trace_dir"]), job, msg.get("exit_codes", {})))
        self._send_control({"t": P.WRITTEN, "path": path})
        self.finished = True


#: Ends of a job in the memory paths that still write the trace so far (kinds of their FATAL reports).
MEMORY_FAILURES = ("device-oom", "swap")


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
    text = ap.parse_args(argv).config
    if text.startswith("@"):  # too long for one argument: in a file (launcher.launch)
        text = Path(text[1:]).read_text()
    cfg = json.loads(text)
    authkey = bytes.fromhex(os.environ.pop("PRISM_AUTHKEY"))
    torch.set_num_threads(max(1, int(cfg.get("threads", 1))))
    coord = Coordinator(
        world_size=cfg["world_size"], num_devices=len(cfg["devices"]), slots_per_device=cfg["slots_per_device"],
        device_of={int(k): v for k, v in cfg["device_of"].items()}, device_names=cfg["devices"],
        hang_timeout=cfg["hang_timeout"], authkey=authkey, host=cfg.get("host", "127.0.0.1"),
        fold=cfg.get("fold"),
    )
    governor = coord.governor
    governor.times_gpu = bool(cfg.get("gpu_timing"))
    notes = []  # said by the launcher
    swap = SwapMode(cfg.get("swap", SwapMode.NONE))
    if swap != SwapMode.NONE:
        caps = [int(c) for c in cfg["device_memory"]]
        try:
            swapper = (BudgetSwapper(caps[0], FakeDevice.from_env()) if cfg.get("swapper") == "budget"
                       else CudaCheckpointSwapper())
        except SwapUnavailable as e:
            if swap != SwapMode.AUTO:
                raise
            swapper = None
            notes.append(f"--swap auto: ranks share each GPU without swaps ({e})")
        if swapper is not None and cfg.get("swapper") != "budget":
            try:
                governor.footprint_check = FootprintCheck(nvml_process_memory())
            except NvmlUnavailable as e:
                notes.append(f"ranks' GPU footprints are not cross-checked with NVML ({e}): swaps plan with "
                             "allocator reserved + a context estimate")
        if swapper is not None:
            governor.enable_swap(swapper, caps, SwapPolicy(cfg.get("swap_policy", SwapPolicy.RESIDENT_FIRST)),
                                 cfg.get("host_memory"), gate_timing=swap == SwapMode.AUTO and governor.times_gpu,
                                 margin=0 if cfg.get("swapper") == "budget" else ADMISSION_MARGIN)
    governor.configure_admission(cfg.get("memory_classes") or {}, cfg.get("rank_cap"))
    notes += governor.say_host_need()
    if cfg.get("predictor"):
        module, _, func = cfg["predictor"].partition(":")
        coord.predictor.set(getattr(importlib.import_module(module), func), Path(cfg["live_trace"]),
                            cfg.get("predictor_options"))
    from torch.distributed import TCPStore

    store = TCPStore(cfg.get("host", "127.0.0.1"), 0, cfg["world_size"], is_master=True, wait_for_workers=False,
                     multi_tenant=False)
    print(json.dumps({"address": list(coord.address), "store_port": store.port, "notes": notes}), flush=True)
    coord.serve()
    del store


if __name__ == "__main__":
    main()
