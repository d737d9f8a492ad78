"""What the trace keeps of a run, recorded as the coordinator sees it: every rank's ops, markers,
slot turns and GPU-timed segments (written by runtime.trace_export)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prism_megatron.runtime.matching import desc_bytes

if TYPE_CHECKING:
    from prism_megatron.runtime.groups import Group
    from prism_megatron.runtime.ranks import RankState


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
    t_wait: float = float("nan")  # an async op: when the program first waited for it (waited())
    wait_clock: float = float("nan")  # the rank's compute clock then


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


class Recorder:
    """The trace's rows so far; times are seconds since the coordinator started."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.ops: list[OpRecord] = []
        self.marks: list[dict] = []
        self.gpu_rows: list[dict] = []  # per compute segment on a GPU: host and device times (gpu table)
        self.slot_log: list[dict] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def op(self, rs: RankState, g: Group, msg: dict) -> OpRecord:
        """Record the op ``msg`` that ``rs`` issued on ``g``; it is pending until completed()."""
        peer, root = msg.get("peer"), msg.get("root")
        nbytes = max(sum(desc_bytes(d[0]) for d in msg["ins"]), sum(desc_bytes(d[0]) for d in msg["outs"]))
        rec = OpRecord(
            rank=rs.rank, index=rs.n_ops, kind=msg["kind"], group=g.id, seq=-1,
            peer=g.ranks[peer] if peer is not None else -1, root=g.ranks[root] if root is not None else -1,
            bytes=nbytes, dtype=(msg["ins"] or msg["outs"] or [(None, "", [])])[0][1],
            shapes=json.dumps([d[2] for d in msg["ins"] + msg["outs"]]), reduce_op=msg.get("redop") or "",
            async_op=bool(msg.get("async_op")), t_issue=self.now(), t_complete=float("nan"),
            compute_before=rs.clock - rs.last_op_clock, label=msg.get("label") or "", op_id=msg["id"],
            splits=(msg["in_splits"], msg["out_splits"]) if "in_splits" in msg else (),
            payload=recorded_payload(msg["ins"]),
        )
        rs.last_op_clock = rs.clock
        rs.n_ops += 1
        rs.pending[msg["id"]] = rec
        if rec.async_op:
            rs.unwaited[msg["id"]] = rec
        self.ops.append(rec)
        return rec

    def completed(self, rs: RankState, op_id: int) -> None:
        rec = rs.pending.pop(op_id, None)
        if rec is not None:
            rec.t_complete = self.now()

    def waited(self, rs: RankState, ids: list[int]) -> None:
        """The program of ``rs`` waits for the async ops ``ids`` (whether or not they are complete)."""
        for op_id in ids:
            rec = rs.unwaited.pop(op_id, None)
            if rec is not None:
                rec.t_wait, rec.wait_clock = self.now(), rs.clock

    def mark(self, rs: RankState, msg: dict) -> None:
        self.marks.append({"rank": rs.rank, "name": msg["name"], "phase": msg["phase"], "t": self.now(),
                           "compute_clock": rs.clock, "attrs": json.dumps(msg["attrs"])})

    def slot_turn(self, rs: RankState, device: str, slot: int) -> None:
        """``rs`` gives back the slot it was granted at ``rs.grant_t``."""
        self.slot_log.append({"rank": rs.rank, "device": device, "slot": slot,
                              "t_grant": rs.grant_t, "t_release": self.now(), "compute_clock": rs.clock})
