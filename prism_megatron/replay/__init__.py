"""Replay: a discrete-event engine over an execution graph (from a PrismTrace or built in Python).

Gives per-rank predicted timelines (compute, exposed communication, bubble), per-iteration times,
the critical path, and a Chrome/Perfetto export. Imports neither the runtime nor Megatron.
"""

from .engine import (
    Breakdown,
    CommSpec,
    CostFn,
    DeadlockError,
    Iteration,
    PathStep,
    ReplayResult,
    Segment,
    replay,
    zero_cost,
)
from .export import to_chrome, write_chrome
from .graph import (
    Comm,
    Compute,
    CpuSync,
    Graph,
    GraphBuilder,
    GraphError,
    Group,
    IncompleteCaptureError,
    Mark,
    Wait,
    graph_from_trace,
)

__all__ = [
    "Breakdown",
    "Comm",
    "CommSpec",
    "Compute",
    "CpuSync",
    "CostFn",
    "DeadlockError",
    "Graph",
    "GraphBuilder",
    "GraphError",
    "Group",
    "IncompleteCaptureError",
    "Iteration",
    "Mark",
    "PathStep",
    "ReplayResult",
    "Segment",
    "Wait",
    "graph_from_trace",
    "replay",
    "to_chrome",
    "write_chrome",
    "zero_cost",
]
