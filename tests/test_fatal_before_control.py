"""A failure a rank reports before the coordinator has read the launcher's CONTROL message still reaches
the launcher: the launcher sends CONTROL before it starts the ranks, but the coordinator may read a
rank's connection first (selectors give no order between connections)."""

from __future__ import annotations

from prism_megatron.runtime import protocol as P
from prism_megatron.runtime.coordinator import Coordinator


class _Conn:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send(self, msg: dict) -> None:
        self.sent.append(msg)


def _coordinator() -> Coordinator:
    return Coordinator(world_size=2, num_devices=1, slots_per_device=1, device_of={0: 0, 1: 0},
                       device_names=["cpu"], hang_timeout=60.0, authkey=b"k" * 16)


def test_a_fatal_raised_before_control_is_sent_when_control_arrives():
    coord = _coordinator()
    abandoned = []
    coord._abandon = abandoned.append
    coord._fatal("fold", "prism: a ring with one live rank")
    assert not coord.finished and not abandoned  # the job is not ended behind the launcher's back
    launcher = _Conn()
    coord._dispatch(launcher, {"t": P.CONTROL, "job": {}, "trace_dir": None})
    sent = [(m["t"], m["kind"], m["report"]) for m in launcher.sent]
    assert sent == [(P.FATAL, "fold", "prism: a ring with one live rank")]


def test_only_the_first_held_fatal_is_sent_and_none_after_control():
    coord = _coordinator()
    coord._fatal("fold", "first")
    coord._fatal("hang", "second")
    launcher = _Conn()
    coord._dispatch(launcher, {"t": P.CONTROL, "job": {}, "trace_dir": None})
    coord._fatal("stall", "third")  # after CONTROL: sent at once
    assert [m["report"] for m in launcher.sent] == ["first", "third"]


def test_a_held_fatal_is_printed_when_the_launcher_never_connects(capsys):
    coord = _coordinator()
    coord._fatal("fold", "prism: the report nobody read")
    coord._abandon("no launcher connected within 60 s")
    err = capsys.readouterr().err
    assert "prism: the report nobody read" in err and "no launcher connected" in err
    assert coord.finished
