"""What the coordinator knows of each logical rank: its connection, state and pending ops."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from multiprocessing.connection import Connection

from prism_megatron.runtime.recorder import OpRecord


class RankStatus(StrEnum):
    """Where a rank is, as the slot scheduler and the hang detector see it."""

    STARTING = "starting"  # connected, has not asked for a slot yet
    QUEUED = "queued"  # asked for a slot
    RUNNING = "running"  # holds a slot and computes
    BLOCKED = "blocked"  # waits for ops (or a prediction) without a slot: a hang if all are
    IDLE = "idle"  # sleeps without a slot (RankClient.idle): it will move again, so it is no hang
    DONE = "done"  # exited, or its connection was lost


@dataclass
class RankState:
    rank: int
    conn: Connection
    state: RankStatus = RankStatus.STARTING
    holding: bool = False  # holds a compute slot now (granted at grant_t)
    clock: float = 0.0  # the rank's own compute clock (runtime work excluded), from its latest message
    last_op_clock: float = 0.0  # that clock at the rank's previous op
    grant_t: float = 0.0
    grant_slot: tuple[int, int] | None = None
    blocked_on: set[int] = field(default_factory=set)
    blocked_since: float = 0.0
    done_ids: set[int] = field(default_factory=set)
    pending: dict[int, OpRecord] = field(default_factory=dict)
    unwaited: dict[int, OpRecord] = field(default_factory=dict)  # async ops the program has not waited for yet
    n_ops: int = 0
    exit_code: int | None = None
    runtime_s: dict | None = None  # the rank's runtime work in its slot turns (RankClient.runtime_s), at exit
    pid: int = 0
    timeouts: dict[int, float] = field(default_factory=dict)  # group id -> the group's own timeout (s)
