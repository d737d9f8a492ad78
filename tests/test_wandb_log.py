"""W&B logging of a report, read back from the offline run's own transaction log (no network).

wandb 0.31 has no Python reader for ``run-<id>.wandb`` any more (the datastore moved into the Go
core), so ``read_run`` below parses the file's framing (wandb's LevelDB-style log: a 7-byte file
header, 32 KiB blocks of CRC32-checked chunks) and decodes each record with wandb's own protobufs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2 as pb  # noqa: E402

from prism_megatron.report import wandb_log  # noqa: E402

GiB = 1 << 30
API_KEY = "a" * 40  # the format wandb accepts; never sent anywhere


@pytest.fixture(scope="module", autouse=True)
def wandb_sandbox(tmp_path_factory: pytest.TempPathFactory):
    """Keep wandb off the user's home and off the network for the whole module.

    A server address nobody listens on makes any network use by an offline run fail loudly. The
    wandb singleton caches settings from the environment, so it is reset on entry and exit.
    """
    root = tmp_path_factory.mktemp("wandb-sandbox")
    mp = pytest.MonkeyPatch()
    env = {"HOME": root / "home", "WANDB_CONFIG_DIR": root / "config", "WANDB_CACHE_DIR": root / "cache",
           "WANDB_DATA_DIR": root / "data", "WANDB_DIR": root / "default-dir", "NETRC": root / "netrc"}
    for key, path in env.items():
        if key != "NETRC":
            path.mkdir()
        mp.setenv(key, str(path))
    mp.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    for key in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY",
                "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_SILENT"):
        mp.delenv(key, raising=False)
    mp.chdir(root)  # wandb also reads ./wandb/settings
    wandb.teardown()
    yield root
    wandb.teardown()
    mp.undo()


# ---- reading an offline run back -------------------------------------------------------------

_BLOCK = 32768
_CHUNK_HEADER = 7  # crc32 (4), length (2), type (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[pb.Record]:
    """Every record of a ``.wandb`` transaction log, checking its header and chunk checksums."""
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a wandb transaction log"
    records, pending, pos = [], b"", 7
    while pos + _CHUNK_HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _CHUNK_HEADER:  # the rest of a block is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + _CHUNK_HEADER])
        chunk = data[pos + _CHUNK_HEADER:pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind == 0 and length == 0:
            break
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad checksum at {pos}"
        if kind == _FULL:
            records.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            records.append(pending + chunk)
    out = []
    for raw in records:
        rec = pb.Record()
        rec.ParseFromString(raw)
        out.append(rec)
    return out


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


@dataclass
class OfflineRun:
    run: pb.RunRecord | None = None
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    artifacts: list[pb.ArtifactRecord] = field(default_factory=list)
    exited: bool = False


def read_run(run_dir: Path) -> OfflineRun:
    """Fold a run directory's transaction log into what the server would show after ``wandb sync``."""
    [log] = run_dir.glob("run-*.wandb")
    out = OfflineRun()
    for rec in read_records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.run = rec.run
            updates = rec.run.config.update
        elif kind == "config":
            updates = rec.config.update
        else:
            updates = ()
        for item in updates:
            out.config[_key(item)] = json.loads(item.value_json)
        if kind == "history":
            out.history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            for item in rec.summary.update:
                out.summary[_key(item)] = json.loads(item.value_json)
            for item in rec.summary.remove:
                out.summary.pop(_key(item), None)
        elif kind == "artifact":
            out.artifacts.append(rec.artifact)
        elif kind == "exit":
            out.exited = True
    return out


# ---- a report ----------------------------------------------------------------------------------


def sample_report() -> dict[str, Any]:
    return {
        "format": "prismreport", "version": 1, "created": "2026-01-01T00:00:00Z", "trace": "/traces/t1",
        "job": {"world_size": 8, "argv": ["pretrain_gpt.py", "--tensor-model-parallel-size", "2"],
                "machine": {"gpus": ["NVIDIA H200"], "cpu": "Intel(R) Xeon(R) Platinum 8480C", "cores": 16}},
        "target": {"gpu": "H100-SXM-80GB", "capacity_bytes": 80 * GiB, "usable_bytes": 79 * GiB,
                   "context_bytes": GiB, "source": "table"},
        "prediction": {
            "provenance": "uncalibrated bare graph", "cluster": "h100-nvlink-ib400",
            # the last iteration differs from the median: the summary must keep the median
            "iteration_times_s": [0.5, 0.3, 0.25],
            "iteration_time_s": 0.3,
            "tokens_per_s": 54612.5,
            "tflops_per_gpu": None,  # null: must not be logged
            "breakdown": [], "critical_path": {"steps": [], "total_steps": 0, "by_kind_s": {}},
        },
        "memory": {
            "source": "allocator peaks",
            "ranks": [{"rank": 0, "class": "pp0 first/stage", "max_allocated": 2 * GiB, "max_reserved": 3 * GiB,
                       "cap": 79 * GiB, "headroom": 76 * GiB, "oom": False}],
            "classes": [
                {"class": "pp0 first/stage", "ranks": [0, 1], "max_allocated": 2 * GiB, "max_reserved": 3 * GiB,
                 "headroom": 76 * GiB},
                {"class": "pp1.last", "ranks": [2, 3], "max_allocated": 80 * GiB, "max_reserved": 81 * GiB,
                 "headroom": -2 * GiB},
                {"class": "unknown-cap", "ranks": [4], "max_allocated": GiB // 2, "max_reserved": GiB,
                 "headroom": None},
            ],
        },
        "oom": [{"rank": 2, "class": "pp1.last", "requested": GiB, "allocated": 80 * GiB, "reserved": 81 * GiB,
                 "max_allocated": 80 * GiB, "max_reserved": 81 * GiB, "cap": 79 * GiB,
                 "message": "CUDA out of memory", "snapshot": None}],
        "swap": None,
        "verdict": "OOM on rank 2 (pp1.last)",
    }


CONFIG = {"recipe": "mini-dense-tp2pp2dp2", "flags": {"tensor_model_parallel_size": 2, "pipeline": 2}}


@pytest.fixture
def timeline(tmp_path: Path) -> Path:
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps({"traceEvents": [{"name": "fwd", "ph": "X", "ts": 0, "dur": 5}]}))
    return path


# ---- tests ---------------------------------------------------------------------------------------


def test_import_has_no_wandb_side_effects():
    import subprocess
    import sys

    code = ("import sys; import prism_megatron.report.wandb_log as w; "
            "assert 'wandb' not in sys.modules, 'wandb imported at module import'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).parents[1])


def test_offline_run_holds_the_figures(tmp_path: Path, timeline: Path):
    logged = wandb_log.log_report(sample_report(), timeline=timeline, config=CONFIG, run_dir=tmp_path / "wb",
                                  name="sample", mode="offline")

    assert logged.mode == "offline" and logged.url is None
    assert logged.note is None  # in particular: the transaction log was complete on return
    assert logged.dir.parent == (tmp_path / "wb" / "wandb").resolve()
    assert logged.dir.name.startswith("offline-run-") and logged.dir.name.endswith(logged.run_id)
    assert logged.sync_command == f"wandb sync {logged.dir}"
    assert "wandb sync" in logged.describe()

    run = read_run(logged.dir)
    assert run.exited
    assert run.run.run_id == logged.run_id and run.run.display_name == "sample"
    assert run.run.project == wandb_log.DEFAULT_PROJECT

    rows = [(r["_step"], r["prism/iteration"], r["prism/predicted_iteration_time_ms"]) for r in run.history]
    assert rows == [(1, 1, 500.0), (2, 2, 300.0), (3, 3, 250.0)]

    s = run.summary
    assert s["prism/predicted_iteration_time_ms"] == pytest.approx(300.0)  # median, not the last row
    assert s["prism/tokens_per_s"] == pytest.approx(54612.5)
    assert "prism/tflops_per_gpu" not in s  # null in the report
    assert s["prism/memory/pp0_first_stage/max_allocated_gib"] == pytest.approx(2.0)
    assert s["prism/memory/pp0_first_stage/max_reserved_gib"] == pytest.approx(3.0)
    assert s["prism/memory/pp0_first_stage/headroom_gib"] == pytest.approx(76.0)
    assert s["prism/memory/pp1_last/headroom_gib"] == pytest.approx(-2.0)
    assert s["prism/memory/unknown-cap/max_reserved_gib"] == pytest.approx(1.0)
    assert "prism/memory/unknown-cap/headroom_gib" not in s
    assert s["prism/oom"] is True
    assert s["prism/verdict"] == "OOM on rank 2 (pp1.last)"
    assert s["prism/provenance"] == "uncalibrated bare graph"

    assert run.config["recipe"] == CONFIG["recipe"]
    assert run.config["flags"] == CONFIG["flags"]
    assert run.config["target_gpu"] == "H100-SXM-80GB"
    assert run.config["emulated_on"] == "Intel(R) Xeon(R) Platinum 8480C, 16 cores"  # a host-bound time is its host's

    [art] = run.artifacts
    assert art.type == "prism-timeline" and art.name == f"prism-timeline-{logged.run_id}"
    [entry] = art.manifest.contents
    assert entry.path == "timeline.json"
    assert entry.digest == base64.b64encode(hashlib.md5(timeline.read_bytes()).digest()).decode()
    assert json.loads(art.metadata)["target_gpu"] == "H100-SXM-80GB"
    assert Path(entry.local_path).read_bytes() == timeline.read_bytes()  # staged for `wandb sync`


def test_resume_into_megatrons_offline_run(tmp_path: Path, timeline: Path):
    run_dir = tmp_path / "megatron-wandb"
    mega = wandb.init(project="mega", dir=str(run_dir), mode="offline", config={"lr": 3e-4, "recipe": "theirs"},
                      settings=wandb.Settings(console="off", quiet=True, x_disable_stats=True))
    mega_id, mega_dir = mega.id, Path(mega.settings.sync_dir).resolve()
    for it in range(1, 6):
        mega.log({"lm loss": 10.0 / it}, step=it)
    mega.finish()

    logged = wandb_log.log_report(sample_report(), timeline=timeline, config=CONFIG, run_dir=run_dir,
                                  project="mega", mode="offline", resume_id=mega_id)

    # Offline resume writes a second fragment of the same run; both are listed for `wandb sync`.
    assert logged.run_id == mega_id and logged.dir != mega_dir and logged.dir.parent == mega_dir.parent
    assert logged.sync_command == f"wandb sync {mega_dir} {logged.dir}"

    ours, theirs = read_run(logged.dir), read_run(mega_dir)
    assert ours.run.run_id == theirs.run.run_id == mega_id and ours.run.project == "mega"
    assert [r["_step"] for r in theirs.history] == [1, 2, 3, 4, 5]
    # Megatron's fragment is untouched; our config sits under "prism" so its args are not replaced.
    assert "prism" not in theirs.config and not any(k.startswith("prism/") for k in theirs.summary)
    assert "recipe" not in ours.config and ours.config["prism"]["recipe"] == CONFIG["recipe"]
    assert ours.config["prism"]["target_gpu"] == "H100-SXM-80GB"
    # Rows keyed by prism/iteration, steps left to wandb (offline it restarts at 0).
    assert [(r["prism/iteration"], r["prism/predicted_iteration_time_ms"]) for r in ours.history] == [
        (1, 500.0), (2, 300.0), (3, 250.0)]
    assert [r["_step"] for r in ours.history] == [0, 1, 2]
    assert ours.summary["prism/predicted_iteration_time_ms"] == pytest.approx(300.0)
    assert ours.summary["prism/oom"] is True
    assert [a.type for a in ours.artifacts] == ["prism-timeline"]


def test_summary_without_prediction():
    report = sample_report()
    report.update(prediction=None, prediction_error="replay failed: cycle", oom=[])
    report["memory"]["ranks"][0]["oom"] = True  # an OOM seen only in the per-rank table still counts
    s = wandb_log.report_summary(report)
    assert not any(k in s for k in ("prism/predicted_iteration_time_ms", "prism/tokens_per_s", "prism/provenance"))
    assert s["prism/prediction_error"] == "replay failed: cycle"
    assert s["prism/oom"] is True

    report["memory"]["ranks"][0]["oom"] = False
    assert wandb_log.report_summary(report)["prism/oom"] is False


def test_class_names_that_sanitise_alike_stay_apart():
    report = sample_report()
    report["memory"]["classes"] = [
        {"class": "pp 0", "ranks": [0], "max_allocated": GiB, "max_reserved": GiB, "headroom": None},
        {"class": "pp/0", "ranks": [1], "max_allocated": 2 * GiB, "max_reserved": 2 * GiB, "headroom": None},
    ]
    s = wandb_log.report_summary(report)
    assert s["prism/memory/pp_0/max_allocated_gib"] == pytest.approx(1.0)
    assert s["prism/memory/pp_0_2/max_allocated_gib"] == pytest.approx(2.0)


def test_mode_choice(monkeypatch: pytest.MonkeyPatch, wandb_sandbox: Path):
    netrc = Path(wandb_sandbox / "netrc")
    assert not netrc.exists()
    assert wandb_log.choose_mode() == "offline"  # nobody logged in
    assert wandb_log.choose_mode("online") == "online"  # explicit wins
    assert wandb_log.choose_mode("dryrun") == "offline"

    monkeypatch.setenv("WANDB_API_KEY", API_KEY)
    assert wandb_log.choose_mode() == "online"
    assert wandb_log.choose_mode("offline") == "offline"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_log.choose_mode() == "offline"  # WANDB_MODE beats being logged in
    assert wandb_log.choose_mode("online") == "online"  # and the argument beats WANDB_MODE
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_log.choose_mode() == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY")

    # `wandb login` writes the key to .netrc for the server's host: that counts as logged in.
    netrc.write_text(f"machine 127.0.0.1:9\n  login user\n  password {API_KEY}\n")
    netrc.chmod(0o600)
    try:
        assert wandb_log.choose_mode() == "online"
    finally:
        netrc.unlink()
    assert wandb_log.choose_mode() == "offline"

    with pytest.raises(ValueError, match="W&B mode"):
        wandb_log.choose_mode("sometimes")


def test_online_that_cannot_connect_falls_back_to_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # Logged in, but the server (a local port nobody listens on) is unreachable.
    monkeypatch.setenv("WANDB_API_KEY", API_KEY)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "1")
    logged = wandb_log.log_report(sample_report(), timeline=None, config=CONFIG, run_dir=tmp_path / "wb")
    assert logged.mode == "offline" and logged.note.startswith("online start failed")
    assert logged.sync_command == f"wandb sync {logged.dir}"
    run = read_run(logged.dir)
    assert run.summary["prism/verdict"] == "OOM on rank 2 (pp1.last)" and len(run.history) == 3


def test_disabled_logs_nothing(tmp_path: Path):
    logged = wandb_log.log_report(sample_report(), timeline=None, config=CONFIG, run_dir=tmp_path / "wb",
                                  mode="disabled")
    assert logged.mode == "disabled" and logged.dir is None and not (tmp_path / "wb").exists()


def test_bad_arguments_fail_before_a_run_starts(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        wandb_log.log_report(sample_report(), timeline=tmp_path / "nope.json", config=CONFIG,
                             run_dir=tmp_path / "wb", mode="offline")
    with pytest.raises(ValueError, match="project"):
        wandb_log.log_report(sample_report(), timeline=None, config=CONFIG, run_dir=tmp_path / "wb",
                             mode="offline", resume_id="abc123")
    assert not (tmp_path / "wb").exists()


def test_compare_logs_one_run_per_layout_in_a_group(tmp_path: Path):
    from prism_megatron.report.compare import comparison_text, layout_of, log_comparison
    from prism_megatron.report.units import fmt_bytes

    fast = layout_of(sample_report(), "tp2pp8", "a/report.json")
    slow_report = sample_report()
    slow_report["prediction"]["iteration_time_s"] = 0.9
    slow = layout_of(slow_report, "tp1pp8", "b/report.json")
    logged = log_comparison([fast, slow], "qwen3-235b", run_dir=tmp_path / "wb", mode="offline")
    assert len({run.run_id for run in logged}) == 2
    runs = [read_run(run.dir) for run in logged]
    assert [r.run.run_group for r in runs] == ["qwen3-235b", "qwen3-235b"]
    assert [r.run.display_name for r in runs] == ["tp2pp8", "tp1pp8"]
    assert [r.config["comparison_rank"] for r in runs] == [1, 2]
    # the comparison's memory column, as the table prints it, sorts the group's table in W&B too
    cls, short = next(iter(fast.excess.items()))
    assert runs[0].config["memory"] == f"OOM, failing request {fmt_bytes(short)} past the cap ({cls})"
    assert comparison_text([fast]).splitlines()[1].endswith(runs[0].config["memory"])
    assert runs[1].summary["prism/predicted_iteration_time_ms"] == pytest.approx(900.0)
