"""The coordinator's configuration: typed, and its one wire form (JSON on its process's stdin)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

#: A coordinator started ahead of its job (``launcher.coordinator_ahead``) finds in this environment variable
#: its end of the socket pair the job's trace-directory lock comes over.
LOCK_SOCKET_ENV = "PRISM_LOCK_SOCKET"


@dataclass(frozen=True)
class CoordinatorConfig:
    """What the coordinator process is started with; the launcher builds it from its LaunchConfig."""

    world_size: int
    devices: list[str]  # "cpu" or "cuda:N"
    slots_per_device: int
    device_of: dict[int, int]  # rank -> index into devices
    hang_timeout: float
    threads: int = 1  # torch threads of the coordinator process
    swap: str = "none"  # none, checkpoint or auto (the launcher's swap_mode)
    swapper: str = "cuda"  # inprocess (runtime.vmm), cuda (the driver's process checkpoint), or their stand-ins
    #   budget-inprocess and budget
    gpu_timing: bool = False
    device_memory: list[int] = field(default_factory=list)  # bytes per device
    host_memory: int | None = None  # bytes swapped-out state may take (None: not limited)
    swap_policy: str = "resident-first"
    memory_classes: dict[int, str] = field(default_factory=dict)  # rank -> class whose peaks admit it (runtime.peaks)
    rank_cap: int | None = None  # each rank's allocator cap in bytes (the target GPU's usable), if any
    memory_estimates: dict[int, int] = field(default_factory=dict)  # rank -> prism's estimate of its class's peak
    predictor: str | None = None  # "module:function" answering live predictions
    predictor_options: dict = field(default_factory=dict)
    live_trace: str = ""
    host: str = "127.0.0.1"  # the address it and the TCPStore listen on
    launcher_pid: int = 0  # it ends the job itself if this process dies (0: no launcher to watch)
    segment_prefix: str = ""  # the job's shared-memory segments (runtime.shm.job_prefix), removed then
    fold: dict | None = None  # a folded job's plan (trace.fold's JSON): live ranks, rep of every rank
    log_path: str | None = None  # started ahead of its job (launcher.coordinator_ahead): its stderr from now on

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CoordinatorConfig:
        """Parse :meth:`to_json`'s output (JSON makes the rank keys of ``device_of`` strings)."""
        data = json.loads(text)
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"coordinator config: unknown field(s) {', '.join(sorted(unknown))}")
        data["device_of"] = {int(k): int(v) for k, v in data["device_of"].items()}
        data["memory_classes"] = {int(k): str(v) for k, v in data.get("memory_classes", {}).items()}
        data["memory_estimates"] = {int(k): int(v) for k, v in data.get("memory_estimates", {}).items()}
        return cls(**data)
