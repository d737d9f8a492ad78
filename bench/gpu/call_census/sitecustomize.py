"""Every Python and C function a process calls inside its forward spans, counted (bench only).

The rank's forward runs 12-29 % longer than the real program's on host-bound configs (docs/measurements.md,
runs 36-40), and the hosts that measured it never held still long enough to say why. A count of the calls each
side makes in its forward is exact on any host: equal counts say the same code runs slower in the rank (the
machine), extra ones name the code the rank adds. Put this directory first on ``PYTHONPATH`` with
``CALL_CENSUS_DIR`` set (``one_gpu_truth.py``'s ``+calls`` steps): every marker sink the process installs
(``prism_megatron.trace.markers.set_sink``: the rank's runtime, the spans driver's recorder) is wrapped so that
each ``forward`` span after the first ``CALL_CENSUS_SKIP`` (default 24: three iterations of eight micro-batches,
the warm-up) runs under ``sys.setprofile``. After each such span ``$CALL_CENSUS_DIR/calls-PID.json`` holds
``{"command", "forwards", "calls": {"FILE:LINE NAME" or "c MODULE.NAME": count}}``, rewritten whole (a rank ends
with ``os._exit``). The counts are the main thread's: the forward runs there. Shadows any other sitecustomize.
"""

import json
import os
import sys

_DIR = os.environ.get("CALL_CENSUS_DIR")


def _short(path: str) -> str:
    for cut in ("site-packages/", "dist-packages/", "/megatron/", "/prism_megatron/", "/torch/"):
        i = path.rfind(cut)
        if i >= 0:
            return path[i + (0 if cut.startswith("/") else len(cut)):].lstrip("/")
    return os.path.basename(path)


class _Census:
    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.pid = os.getpid()
        self.seen = 0  # forward spans begun
        self.counting = False
        self.calls: dict[str, int] = {}
        self.forwards = 0

    def profile(self, frame, event, arg) -> None:
        if event == "call":
            code = frame.f_code
            key = f"{_short(code.co_filename)}:{code.co_firstlineno} {code.co_name}"
        elif event == "c_call":
            key = f"c {getattr(arg, '__module__', None) or type(getattr(arg, '__self__', None)).__name__}." \
                  f"{getattr(arg, '__qualname__', getattr(arg, '__name__', '?'))}"
        else:
            return
        self.calls[key] = self.calls.get(key, 0) + 1

    def begin(self) -> None:
        if os.getpid() != self.pid:  # a forked child (a rank) counts afresh, into a file of its own
            self.pid, self.seen, self.calls, self.forwards = os.getpid(), 0, {}, 0
        self.seen += 1
        if self.seen > self.skip:
            self.counting = True
            sys.setprofile(self.profile)

    def end(self) -> None:
        if not self.counting:
            return
        sys.setprofile(None)
        self.counting = False
        self.forwards += 1
        path = os.path.join(_DIR, f"calls-{self.pid}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"command": " ".join(sys.argv[:6]), "forwards": self.forwards, "calls": self.calls}, f)
        os.replace(path + ".tmp", path)


class _Wrapped:
    """A marker sink whose measured forward spans run under the census; everything else passes through."""

    def __init__(self, sink, census: _Census) -> None:
        self.sink = sink
        self.census = census

    def record_mark(self, name, phase, attrs) -> None:
        if name == "forward" and phase == "E":
            self.census.end()
        self.sink.record_mark(name, phase, attrs)
        if name == "forward" and phase == "B":
            self.census.begin()


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    try:
        from prism_megatron.trace import markers as _markers
    except ImportError:
        _markers = None
    if _markers is not None:
        _census = _Census(int(os.environ.get("CALL_CENSUS_SKIP", "24")))
        _original = _markers.set_sink

        def set_sink(sink):
            return _original(sink if sink is None or isinstance(sink, _Wrapped) else _Wrapped(sink, _census))

        _markers.set_sink = set_sink
