"""Log a PrismReport's predictions to Weights & Biases.

Offline by default: prism often runs where there is no network (a login node, a laptop on a
plane), so a run is written locally and the user uploads it later with ``wandb sync DIR``. Online
only when the user configured W&B (an API key in the environment, ``.netrc`` or wandb's settings),
because ``wandb.init`` online without credentials would prompt or fail.

``wandb`` is imported inside the functions: importing this module must not start wandb's service,
read its settings or touch the network.

Keys (all under ``prism/``, so they sit in their own section next to Megatron's own metrics):
per iteration ``predicted_iteration_time_ms`` against ``prism/iteration``; in the summary the median
``predicted_iteration_time_ms``, ``tokens_per_s``, ``tflops_per_gpu``,
``memory/<class>/{max_allocated_gib,max_reserved_gib,headroom_gib}``, ``oom``, ``verdict``,
``provenance``; for a folded job ``fold/{world_size,live_ranks}`` and per rank class
``classes/<class>/{ranks,sandbox_ranks,compute_ms,exposed_comm_ms,bubble_ms}`` (not one row per rank).
A figure the report has as null is left out, never filled in.
"""

from __future__ import annotations

import os
import re
import shlex
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GiB = 1 << 30
DEFAULT_PROJECT = "prism-megatron"
TIMELINE_ARTIFACT_TYPE = "prism-timeline"
ITERATION_KEY = "prism/iteration"
ITERATION_TIME_KEY = "prism/predicted_iteration_time_ms"
#: wandb waits 90 s by default; we fall back to offline on failure, so a shorter wait loses nothing.
ONLINE_INIT_TIMEOUT_S = 30.0
_MODES = {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline", "disabled": "disabled"}


@dataclass(frozen=True)
class LoggedRun:
    """Where the logged run lives, for the CLI to print."""

    mode: str  # online, offline or disabled
    run_id: str | None
    dir: Path | None  # the run's local directory (wandb's sync_dir)
    url: str | None  # online only
    sync_command: str | None  # offline only: uploads the run later
    note: str | None = None  # e.g. why online fell back to offline

    def describe(self) -> str:
        if self.mode == "disabled":
            return "W&B: disabled (WANDB_MODE=disabled); nothing logged"
        lines = [f"W&B ({self.mode}): run {self.run_id} in {self.dir}"]
        if self.url:
            lines.append(f"  {self.url}")
        if self.sync_command:
            lines.append(f"  upload later with: {self.sync_command}")
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)


def has_credentials() -> bool:
    """Whether the user configured W&B credentials, without asking the server.

    Uses wandb's own lookup (``WANDB_API_KEY``/``WANDB_IDENTITY_TOKEN_FILE``, ``.netrc`` for the
    configured host, wandb's settings files) with ``prompt=False, verify=False``: no prompt and no
    network. A ``WANDB_API_KEY`` in an invalid format still counts as configured: the user meant
    to go online, and the online start fails over to offline with wandb's message as the note.
    """
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        settings = wandb_setup.singleton().settings
        host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
        auth = wbauth.authenticate_session(host=host, source="prism", prompt=False, update_session=False)
        return auth is not None
    except Exception:  # an older/newer wandb without this API, or a malformed key/netrc entry
        return bool(os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"))


def choose_mode(mode: str | None = None) -> str:
    """online, offline or disabled: explicit ``mode``, else ``WANDB_MODE``, else online iff logged in.

    A mode set with ``wandb offline``/``wandb disabled`` (wandb's settings files) counts as the
    user's choice too; wandb's default "online" does not, since without credentials it cannot work.
    """
    chosen = mode or os.environ.get("WANDB_MODE") or None
    if chosen is None:
        from wandb.sdk import wandb_setup

        configured = wandb_setup.singleton().settings.mode
        if configured != "online":
            chosen = configured
    if chosen is None:
        return "online" if has_credentials() else "offline"
    if chosen not in _MODES:
        raise ValueError(f"W&B mode {chosen!r}: expected one of online, offline, disabled")
    return _MODES[chosen]


def metric_key(name: str) -> str:
    """A W&B-safe key segment: ``/`` would open a section and ``.`` reads as nesting."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_") or "unnamed"


def _gib(value: int | None) -> float | None:
    return None if value is None else value / GiB


def report_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The summary figures of a report, keyed as logged; null figures are absent."""
    out: dict[str, Any] = {}
    pred = report.get("prediction") or {}
    if pred.get("iteration_time_s") is not None:
        out[ITERATION_TIME_KEY] = pred["iteration_time_s"] * 1e3
    for src, key in (("tokens_per_s", "prism/tokens_per_s"), ("tflops_per_gpu", "prism/tflops_per_gpu")):
        if pred.get(src) is not None:
            out[key] = pred[src]
    if pred.get("provenance") is not None:
        out["prism/provenance"] = pred["provenance"]
    bound = pred.get("host_bound")
    if bound:  # the headline compute on two clocks (a trace measured on GPUs)
        out["prism/compute_ms"] = bound["compute_s"] * 1e3
        out["prism/host_bound_ms"] = bound["host_bound_s"] * 1e3
        out["prism/device_busy_ms"] = bound["device_busy_s"] * 1e3
    if report.get("prediction") is None and report.get("prediction_error"):
        out["prism/prediction_error"] = report["prediction_error"]
    seen: dict[str, int] = {}
    for cls in (report.get("memory") or {}).get("classes") or []:
        name = metric_key(str(cls.get("class", "")))
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:  # two class names that sanitise alike must not overwrite each other
            name = f"{name}_{seen[name]}"
        for src, suffix in (("max_allocated", "max_allocated_gib"), ("max_reserved", "max_reserved_gib"),
                            ("headroom", "headroom_gib")):
            if cls.get(src) is not None:
                out[f"prism/memory/{name}/{suffix}"] = _gib(cls[src])
    fold = report.get("fold")
    if fold:
        out["prism/fold/world_size"] = fold["world_size"]
        out["prism/fold/live_ranks"] = len(fold["live"])
        seen = {}
        for cls in fold["classes"]:
            name = metric_key(str(cls["name"]))
            seen[name] = seen.get(name, 0) + 1
            if seen[name] > 1:
                name = f"{name}_{seen[name]}"
            out[f"prism/classes/{name}/ranks"] = cls["count"]
            out[f"prism/classes/{name}/sandbox_ranks"] = len(cls["sandbox"])
            for src, suffix in (("compute_s", "compute_ms"), ("exposed_comm_s", "exposed_comm_ms"),
                                ("bubble_s", "bubble_ms"), ("host_bound_s", "host_bound_ms"),
                                ("device_busy_s", "device_busy_ms")):
                if cls.get(src) is not None:
                    out[f"prism/classes/{name}/{suffix}"] = cls[src] * 1e3
    mem_ranks = (report.get("memory") or {}).get("ranks") or []
    out["prism/oom"] = bool(report.get("oom")) or any(r.get("oom") for r in mem_ranks)
    if report.get("verdict") is not None:
        out["prism/verdict"] = report["verdict"]
    return out


def _offline_sync_command(sync_dir: Path, run_id: str, resumed: bool) -> str:
    """``wandb sync`` for this run; a resumed run also needs the fragments written before it.

    Offline, each ``wandb.init`` of the same id writes its own ``offline-run-<time>-<id>``
    directory; wandb (0.31) uploads several fragments of one run in order of start time.
    """
    dirs = [sync_dir]
    if resumed:
        # offline-run-YYYYMMDD_HHMMSS-<id>, with -1, -2, ... when two start in the same second
        pattern = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
        found = [(m.group(1), int(m.group(2) or 0), p) for p in sync_dir.parent.iterdir()
                 if p.is_dir() and (m := pattern.fullmatch(p.name))]
        dirs = [p for _, _, p in sorted(found)] or dirs
    return "wandb sync " + " ".join(shlex.quote(str(d)) for d in dirs)


def _has_exit_record(path: Path) -> bool:
    """Whether a ``.wandb`` transaction log already holds the run's exit record.

    The file is wandb's LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks (crc32,
    length, type: 1 full, 2 first, 3 middle, 4 last), each record a ``wandb_internal_pb2.Record``.
    A chunk cut short or failing its checksum means the writer is not done yet.
    """
    from wandb.proto import wandb_internal_pb2

    try:
        data = path.read_bytes()
    except OSError:
        return False
    block, header, pos, pending = 32768, 7, 7, b""
    while pos + header <= len(data):
        if block - pos % block < header:  # the tail of a block too short for a chunk is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        chunk = data[pos + header:pos + header + length]
        if (kind == 0 and length == 0) or len(chunk) < length:
            return False
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            return False
        pos += header + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "exit":
                return True
    return False


def wait_for_transaction_log(path: Path, timeout_s: float = 10.0) -> bool:
    """Wait until the run's transaction log is on disk; False if it is not within ``timeout_s``.

    wandb 0.31's ``run.finish()`` returns before wandb-core has flushed ``run-<id>.wandb`` (seen:
    still only its 7-byte header right after finish, complete some 50 ms later; ``wandb.teardown()``
    would flush it but also stops wandb for the rest of the process). The data is not lost either
    way, but the directory we return should be complete when we say where it is.
    """
    deadline = time.monotonic() + timeout_s
    while not _has_exit_record(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def log_report(
    report: dict[str, Any],
    *,
    timeline: Path | None,
    config: dict[str, Any],
    run_dir: Path,
    project: str | None = None,
    entity: str | None = None,
    name: str | None = None,
    mode: str | None = None,
    resume_id: str | None = None,
    group: str | None = None,
) -> LoggedRun:
    """Log ``report`` to W&B and say where the run lives.

    ``config`` is the recipe and flags; the target GPU is added. ``timeline`` (a JSON file) goes in
    as an artifact of type ``prism-timeline``. ``run_dir`` is wandb's ``dir`` (runs land in
    ``run_dir/wandb/``). An online start that fails (no network, bad key) falls back to offline
    rather than losing the figures, after at most 30 s (``WANDB_INIT_TIMEOUT`` if set); the
    returned note says so.

    ``resume_id`` logs into an existing run, Megatron's own (``--wandb-project``), with
    ``resume="allow"``: pass the same ``run_dir``, ``project`` and ``entity`` Megatron used. Then
    the config goes under ``prism`` (so Megatron's args are not overwritten), the iteration rows
    are not given explicit steps (online, wandb continues after Megatron's last step, and a step
    below it would be dropped) and are keyed by ``prism/iteration`` instead. Offline (wandb 0.31),
    resume does not fail but cannot see the earlier run: it writes a second fragment
    ``offline-run-<time>-<id>`` with the same run id, ``run.resumed`` is False and its steps
    restart at 0; ``wandb sync`` of both fragments (the returned command lists them) uploads them
    into one run in order of start time. The summary, config and artifact merge into the run;
    the iteration rows' ``_step`` may then lie under Megatron's, but ``prism/iteration`` orders them.

    ``group``: W&B run group, e.g. one run per layout of ``prism-megatron compare``.
    """
    if resume_id is not None and not project:
        # wandb would otherwise start a new run of that id in its default project
        raise ValueError("resume_id needs the project the run belongs to (Megatron's --wandb-project)")
    if timeline is not None and not Path(timeline).is_file():
        raise FileNotFoundError(f"timeline {timeline} does not exist")
    chosen = choose_mode(mode)
    if chosen == "disabled":
        return LoggedRun("disabled", None, None, None, None)
    run_dir = Path(run_dir).resolve()  # the printed sync command must work from any directory
    run_dir.mkdir(parents=True, exist_ok=True)
    note = None
    try:
        run = _init(chosen, run_dir=run_dir, project=project, entity=entity, name=name, resume_id=resume_id,
                    group=group)
    except Exception as exc:
        if chosen != "online":
            raise
        first_line = (str(exc).strip().splitlines() or [""])[0]
        note = f"online start failed ({type(exc).__name__}: {first_line}); logged offline instead"
        chosen = "offline"
        run = _init(chosen, run_dir=run_dir, project=project, entity=entity, name=name, resume_id=resume_id,
                    group=group)
    try:
        _log(run, report, timeline=Path(timeline) if timeline else None, config=config, resumed=resume_id is not None)
    except BaseException:
        run.finish(exit_code=1)  # a failed run, not a silently partial one
        raise
    sync_dir, sync_file = Path(run.settings.sync_dir), Path(run.settings.sync_file)
    url = run.url if chosen == "online" else None
    run_id = run.id
    run.finish()
    if not wait_for_transaction_log(sync_file):
        note = "; ".join(filter(None, [note, f"{sync_file.name} is still being written; it is complete "
                                             "once this process has exited"]))
    sync = _offline_sync_command(sync_dir, run_id, resume_id is not None) if chosen == "offline" else None
    return LoggedRun(chosen, run_id, sync_dir, url, sync, note)


def _init(mode: str, *, run_dir: Path, project: str | None, entity: str | None, name: str | None,
          resume_id: str | None, group: str | None = None) -> Any:
    import wandb

    resumed = resume_id is not None
    extra: dict[str, Any] = {}
    if mode == "online":  # read here: wandb's settings hold the environment of their first use
        extra["init_timeout"] = float(os.environ.get("WANDB_INIT_TIMEOUT") or ONLINE_INIT_TIMEOUT_S)
    settings = wandb.Settings(
        **extra,
        console="off",  # do not capture prism's own terminal output into the run
        quiet=True,  # prism prints where the run lives itself
        x_disable_stats=True,  # this host's CPU/GPU load says nothing about the predicted job
        # Into Megatron's run: keep its metadata (program, args, host) and requirements, not ours.
        x_disable_meta=resumed,
        x_save_requirements=not resumed,
    )
    return wandb.init(
        project=project or DEFAULT_PROJECT,
        entity=entity,
        name=name,
        group=group,
        dir=str(run_dir),
        mode=mode,
        id=resume_id,
        resume="allow" if resumed else None,
        job_type=None if resumed else "prism-prediction",
        tags=None if resumed else ["prism"],
        reinit="create_new",  # never finish or reuse a run the caller may have open
        settings=settings,
    )


def _log(run: Any, report: dict[str, Any], *, timeline: Path | None, config: dict[str, Any], resumed: bool) -> None:
    import wandb

    from .terminal import machine_name

    target = report.get("target") or {}
    # the emulating machine beside the target: a host-bound rank's time is its host's, so runs filter by it
    cfg = {**config, "target_gpu": target.get("gpu"), "emulated_on": machine_name(report)}
    if resumed:
        run.config.update({"prism": cfg}, allow_val_change=True)
    else:
        run.config.update(cfg, allow_val_change=True)

    # summary="none": wandb would otherwise set the summary to the last row at finish (the last row
    # is flushed after our explicit summary), replacing the median with the last iteration.
    run.define_metric(ITERATION_KEY, summary="none")
    run.define_metric(ITERATION_TIME_KEY, step_metric=ITERATION_KEY, summary="none")
    times = (report.get("prediction") or {}).get("iteration_times_s") or []
    for i, t in enumerate(times, start=1):
        if t is None:
            continue
        row = {ITERATION_KEY: i, ITERATION_TIME_KEY: t * 1e3}
        if resumed:
            run.log(row)
        else:
            run.log(row, step=i)

    run.summary.update(report_summary(report))

    if timeline is not None:
        art = wandb.Artifact(
            f"prism-timeline-{run.id}",
            type=TIMELINE_ARTIFACT_TYPE,
            description="predicted timeline of the emulated job (prism-megatron)",
            metadata={"trace": report.get("trace"), "target_gpu": target.get("gpu"),
                      "world_size": (report.get("job") or {}).get("world_size"),
                      "provenance": (report.get("prediction") or {}).get("provenance")},
        )
        art.add_file(str(timeline), name=timeline.name)
        run.log_artifact(art)
