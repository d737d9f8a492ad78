"""Each forward of a process, counted or timed from inside (bench only).

The rank's forward runs 12-29 % longer than the real program's on host-bound configs (docs/measurements.md,
runs 36-41), and the hosts that measured it never held still long enough to say why. Two probes tell the
candidates apart on any host, each run the same way in the real program and in the emulated rank:
- ``FORWARD_PROBE=calls``: every Python and C function called inside each forward, counted under
  ``sys.setprofile`` (counts, not times: the host's speed moves them only where the program branches on time;
  equal counts say the same code runs, extra ones name the code the rank adds);
- ``FORWARD_PROBE=canary``: at each forward's start, the host cost of an empty Python call, a one-element ATen
  add on the CPU and one on the GPU (``host_probe.py``'s three measures, a few hundred of each): how fast this
  process's host issues work at the point the forward starts, so a rank on a slower machine is told from a rank
  whose program does more;
- ``FORWARD_PROBE=times``: the canary, then each function's own time inside the forward under ``sys.setprofile``
  (its time less that of the functions it called; a C function's is the ATen op or driver call it wraps): where
  equal counts and an equal canary leave a forward slower, the functions whose own time grew. The profiler's cost
  per call lands in every function alike on both sides; the canary marks the forwards the host ran at full speed.

Put this directory first on ``PYTHONPATH`` with ``FORWARD_PROBE_DIR`` set (``one_gpu_truth.py``'s ``+calls``,
``+canary`` and ``+times`` steps): every marker sink the process installs
(``prism_megatron.trace.markers.set_sink``: the rank's runtime, the spans driver's recorder) is wrapped so that
each ``forward`` span after the first ``FORWARD_PROBE_SKIP`` (default 24: three iterations of eight
micro-batches, the warm-up) is probed. After each
such span ``$FORWARD_PROBE_DIR/MODE-PID.json`` holds ``{"command", "forwards", "calls": {"FILE:LINE NAME" or
"c MODULE.NAME": count}}`` or ``{..., "canary": {"python_us": [...], "aten_cpu_us": [...], "cuda_launch_us":
[...]}}`` (one value per forward), or for times ``{..., "forward": [{"python_us": canary, "ms": the forward's
profiled length, "usage": {the main thread's ``USAGE`` in it}, "self_us": {function: microseconds}, "calls":
{function: calls}}, ...], "dynamo": ..., "process": its fingerprint, "callers": {wait: {caller chain: count}},
"mutations": {"censuses": n, "classes": {name: censuses it changed in}, "modules": {...}}}`` (functions of 20 us or
more; ``WAITS`` for the callers; ``probe_mutations.py``), rewritten whole (a rank ends with ``os._exit``). The probes
run on the main thread: the forward runs there. Shadows any other sitecustomize.
"""

import json
import os
import resource
import sys
import time

_DIR = os.environ.get("FORWARD_PROBE_DIR")
_MODE = os.environ.get("FORWARD_PROBE", "calls")
#: the canary's calls per measure at each forward: ~0.1 ms of Python, ~0.3 ms of ATen, ~1 ms of launches
CANARY_OPS = {"python_us": 2000, "aten_cpu_us": 300, "cuda_launch_us": 150}
#: with times, the canary also times what the forwards' slowest frames do (a thread-local's attribute, a weak
#: reference with a callback, an environment read, a module's construction, Inductor's per-call bookkeeping, a
#: softmax on the GPU), so a process whose slow frames are slow everywhere is told from one where they are slow
#: only inside the forward
SUSPECT_OPS = {"tls_us": 2000, "weakref_us": 500, "environ_us": 500, "module_us": 100, "metrics_us": 1000,
               "softmax_us": 100, "isinstance_us": 2000, "data_ptr_us": 1000, "clock_us": 2000, "record_us": 200,
               "compiled_us": 100}
#: with times, every this many probed forwards (``FORWARD_PROBE_CENSUS_EVERY``) the classes and module namespaces
#: changed since the last census are counted (``probe_mutations.py``; a census walks every class, tens of
#: milliseconds, between two forwards)
CENSUS_EVERY = int(os.environ.get("FORWARD_PROBE_CENSUS_EVERY", "8"))
#: environment variables whose values go into the process fingerprint (by prefix): what may change how torch,
#: the allocator or the interpreter run
ENV_PREFIXES = ("TORCH", "PYTORCH", "CUDA", "NCCL", "OMP", "MKL", "MALLOC", "PYTHON", "LD_", "TRITON", "INDUCTOR",
                "KINETO", "NVTE", "GLIBC")
#: C functions that make the host wait for the device (or copy to it): with times, each call's callers are kept,
#: so a wait one side adds is traced to the code that asked for it
WAITS = ("synchronize", "pin_memory", "item", "tolist", "cpu", "_local_scalar_dense", "wait")
#: how many of the calling frames name a caller
CALLER_DEPTH = 6
#: a function's own time in one forward below this is left out of the times file (microseconds)
KEEP_US = 20
MODES = ("calls", "canary", "times")
#: with times, the main thread's resource use in each forward (``getrusage(RUSAGE_THREAD)``): page faults, minor
#: (a page mapped, copied on write, or a huge page split) and major, and context switches, voluntary (it blocked)
#: and not (preempted): what slows every frame of a thread alike, where the canary before the forward did not see it
USAGE = ("ru_minflt", "ru_majflt", "ru_nvcsw", "ru_nivcsw")


def _key(frame, event: str, arg) -> str:
    """A function's name in the files: "FILE:LINE NAME" for Python, "c MODULE.NAME" for C."""
    if event == "call":
        code = frame.f_code
        return f"{_short(code.co_filename)}:{code.co_firstlineno} {code.co_name}"
    return f"c {getattr(arg, '__module__', None) or type(getattr(arg, '__self__', None)).__name__}." \
           f"{getattr(arg, '__qualname__', getattr(arg, '__name__', '?'))}"


def _short(path: str) -> str:
    for cut in ("site-packages/", "dist-packages/", "/megatron/", "/prism_megatron/", "/torch/"):
        i = path.rfind(cut)
        if i >= 0:
            return path[i + (0 if cut.startswith("/") else len(cut)):].lstrip("/")
    return os.path.basename(path)


def _waits(key: str) -> bool:
    """Whether a C function's name is one of ``WAITS`` (or ends in "_" and one: ``torch._C._cuda_synchronize``)."""
    name = key.rsplit(".", 1)[-1]
    return not name.startswith("is_") and any(name == w or name.endswith("_" + w) for w in WAITS)


def _empty() -> None:
    return None


class _Probe:
    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.pid = os.getpid()
        self.seen = 0  # forward spans begun
        self.counting = False
        self.calls: dict[str, int] = {}
        self.canary: dict[str, list[float]] = {k: [] for k in (*CANARY_OPS, *SUSPECT_OPS)}
        self.operands = None
        self.forwards = 0
        self.stack: list[list] = []
        self.own: dict[str, int] = {}
        self.n: dict[str, int] = {}  # calls per function in this forward: own time per call, and counts apart
        self.timings: list[dict] = []
        self.began = 0
        self.usage = None  # the main thread's getrusage at the probed forward's start
        self.seen_in: dict[str, str] = {}  # per function, the dynamo frame callback at its first call in a forward
        self.codes: dict = {}
        self.callbacks: dict[str, set] = {}
        self.totals: dict[str, int] = {}
        self.fingerprint: dict | None = None
        self.callers: dict[str, dict[str, int]] = {}  # per waiting C function, its caller chains counted
        self.census = None  # probe_mutations.Census of the last count, with times
        self.mutations: dict = {"censuses": 0, "classes": {}, "modules": {}}

    def profile(self, frame, event, arg) -> None:
        if event in ("call", "c_call"):
            key = _key(frame, event, arg)
            self.calls[key] = self.calls.get(key, 0) + 1

    def timed(self, frame, event, arg) -> None:
        """Each function's own time: a stack of [function, start, its callees' time]; a return with nothing on
        the stack is of a frame begun before the probe (the marker's callers), not counted."""
        now = time.perf_counter_ns()
        if event in ("call", "c_call"):
            key = _key(frame, event, arg)
            if event == "c_call" and _waits(key):
                chain = " < ".join(k for k, _, _ in reversed(self.stack[-CALLER_DEPTH:]))
                counted = self.callers.setdefault(key, {})
                counted[chain] = counted.get(chain, 0) + 1
            self.stack.append([key, now, 0])
            self.n[key] = self.n.get(key, 0) + 1
            if event == "call" and key not in self.seen_in:
                self.seen_in[key] = _dynamo_callback()
                self.codes.setdefault(key, frame.f_code)
        elif self.stack:  # return, c_return, c_exception
            key, start, inner = self.stack.pop()
            took = now - start
            self.own[key] = self.own.get(key, 0) + took - inner
            if self.stack:
                self.stack[-1][2] += took

    def sing(self) -> None:
        """The canary: each measure's microseconds per call, at this point of this process."""
        import torch

        if self.operands is None:
            cpu = [torch.ones(1) for _ in range(3)]
            gpu = [torch.ones(1, device="cuda") for _ in range(3)] if torch.cuda.is_available() else None
            self.operands = (cpu, gpu)
        (a, b, c), gpu = self.operands
        steps = {"python_us": _empty, "aten_cpu_us": lambda: torch.add(a, b, out=c)}
        if gpu is not None:
            ga, gb, gc = gpu
            steps["cuda_launch_us"] = lambda: torch.add(ga, gb, out=gc)
        if _MODE == "times":
            steps.update(self.suspects(gpu))
        for key, step in steps.items():
            n = CANARY_OPS.get(key) or SUSPECT_OPS[key]
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            self.canary[key].append((time.perf_counter() - t0) / n * 1e6)

    @staticmethod
    def suspects(gpu) -> dict:
        import threading
        import weakref

        import torch

        tls = threading.local()
        tls.value = 1
        holder = type("Holder", (), {})()

        def tls_read():
            return tls.value if hasattr(tls, "value") else None

        t = torch.ones(1)

        def record():
            with torch.autograd.profiler.record_function("probe"):
                pass

        out = {"tls_us": tls_read, "weakref_us": lambda: weakref.ref(holder, lambda r: None),
               "environ_us": lambda: os.environ.get("PATH"), "module_us": lambda: torch.nn.Softmax(dim=-1),
               "isinstance_us": lambda: isinstance(t, torch.Tensor), "data_ptr_us": t.data_ptr,
               "clock_us": time.perf_counter_ns, "record_us": record}
        try:
            from torch._dynamo.utils import get_runtime_metrics_context
            out["metrics_us"] = get_runtime_metrics_context
        except ImportError:
            pass
        if gpu is not None:
            x = gpu[0]
            out["softmax_us"] = lambda: torch.nn.functional.softmax(x, dim=-1)
            compiled = _compiled()
            compiled(x)  # compiled at its first call, before the canary times it
            out["compiled_us"] = lambda: compiled(x)
        return out

    def begin(self) -> None:
        if os.getpid() != self.pid:  # a forked child (a rank) probes afresh, into a file of its own
            self.__init__(self.skip)
        self.seen += 1
        if self.seen <= self.skip:
            return
        self.counting = True
        if _MODE in ("canary", "times"):
            self.sing()
        if _MODE == "times":
            self.stack, self.own, self.n, self.seen_in = [], {}, {}, {}
            self.usage = resource.getrusage(resource.RUSAGE_THREAD)
            self.began = time.perf_counter_ns()
            sys.setprofile(self.timed)
        elif _MODE == "calls":
            sys.setprofile(self.profile)

    def end(self) -> None:
        if not self.counting:
            return
        sys.setprofile(None)
        used = resource.getrusage(resource.RUSAGE_THREAD) if _MODE == "times" else None
        self.counting = False
        self.forwards += 1
        if _MODE == "times":
            kept = {k: v for k, v in self.own.items() if v >= KEEP_US * 1000}
            self.timings.append({"python_us": self.canary["python_us"][-1],
                                 "canary": {k: v[-1] for k, v in self.canary.items() if v},
                                 "ms": (time.perf_counter_ns() - self.began) / 1e6,
                                 "usage": {k[3:]: getattr(used, k) - getattr(self.usage, k) for k in USAGE},
                                 "self_us": {k: round(v / 1e3) for k, v in kept.items()},
                                 "calls": {k: self.n[k] for k in kept}})
            for k, v in self.own.items():
                self.totals[k] = self.totals.get(k, 0) + v
            for k, cb in self.seen_in.items():
                self.callbacks.setdefault(k, set()).add(cb)
            if self.fingerprint is None:
                self.fingerprint = process_fingerprint()
            try:  # a probe's reading never stops the program it probes
                self.count_mutations()
            except Exception as e:
                self.mutations["unreadable"] = f"the census failed: {type(e).__name__}: {e}"
            found = {"forward": self.timings, "dynamo": self.dynamo_state(), "process": self.fingerprint,
                     "callers": self.callers, "mutations": self.mutations}
        elif _MODE == "canary":
            found = {"canary": {k: v for k, v in self.canary.items() if v}}
        else:
            found = {"calls": self.calls}
        path = os.path.join(_DIR, f"{_MODE}-{self.pid}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"command": " ".join(sys.argv[:6]), "forwards": self.forwards, **found}, f)
        os.replace(path + ".tmp", path)


    def count_mutations(self) -> None:
        """Every ``CENSUS_EVERY`` forwards, the classes and module namespaces changed since the last census, each
        counted once per census it changed in (``probe_mutations.py``); the first census also names the classes that
        hold no version tag at all (into the fingerprint)."""
        if (self.forwards - 1) % CENSUS_EVERY and self.census is not None:
            return
        from probe_mutations import Census

        if self.census is not None:
            self.mutations["censuses"] += 1
            for kind, names in self.census.changed().items():
                for name in names:
                    self.mutations[kind][name] = self.mutations[kind].get(name, 0) + 1
        self.census = Census()
        if not self.census.readable:
            self.mutations["unreadable"] = "this interpreter's class version tags cannot be read"
        elif "types.unversioned" not in self.fingerprint:
            names = self.census.unversioned()
            self.fingerprint["types.unversioned"] = f"{len(names)}: {' '.join(names[:12])}"

    def dynamo_state(self) -> dict:
        """Per Python function of 20 us or more of own time per forward: the dynamo frame callbacks it was called
        under, its code's compiled entries (each a guard set the frame evaluator checks at every call) and how far
        its bytecode is specialised (``specialization``); and dynamo's counters (graph breaks, recompilations,
        cache hits)."""
        try:
            from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
            from torch._dynamo.utils import counters
        except ImportError:
            return {}
        floor = KEEP_US * 1000 * max(self.forwards, 1)
        functions = {}
        for k, code in self.codes.items():
            if self.totals.get(k, 0) >= floor:
                try:  # a probe's reading never stops the program it probes
                    special = specialization(code)
                except Exception as e:
                    special = f"? {type(e).__name__}"
                functions[k] = [sorted(self.callbacks.get(k, ())), len(_debug_get_cache_entry_list(code)), special]
        return {"functions": functions,
                "counters": {str(k): {str(kk): vv for kk, vv in v.items()} for k, v in counters.items()}}


#: families whose plain form is already the fast one (super-instructions and the quickened resume): never "left generic"
QUICKENED = ("LOAD_FAST", "LOAD_CONST", "STORE_FAST", "RESUME", "EXTENDED_ARG", "JUMP_BACKWARD")


def specialization(code) -> str:
    """How far the interpreter specialised ``code``'s bytecode so far: "k/n" of its n instructions of a
    specialisable family, then those left generic or adaptive ("LOAD_ATTR@12 ..."). The same frame left generic in
    one process and specialised in the other costs more per call there: an attribute cache that keeps failing, a
    class whose version tag ran out after too many changes to it.

    Read from the adaptive bytecode itself (opcode and offset, caches skipped), not through ``dis``'s
    instruction listing, which resolves every argument's name and fails on some specialised forms (3.12)."""
    import dis
    import opcode

    families = {k: v for k, v in getattr(opcode, "_specializations", {}).items() if k not in QUICKENED}
    special = {s for v in families.values() for s in v}
    raw = getattr(code, "_co_code_adaptive", None)
    if raw is None or not hasattr(dis, "_deoptop"):
        return "?"
    names, caches = dis._all_opname, dis._inline_cache_entries
    seen, generic, instrumented, at = 0, [], 0, 0
    while at < len(raw):
        op = raw[at]
        name = names[op]
        if name.startswith("INSTRUMENTED_"):  # a profiler's event hides the form beneath until the code runs again
            base = opcode.opmap.get(name[len("INSTRUMENTED_"):])
            if base is None:  # a line or instruction event: the instruction beneath is kept elsewhere
                return "? instrumented"
            instrumented += name[len("INSTRUMENTED_"):] in families
            at += 2 + 2 * caches[base]
            continue
        if name in families or name in special:
            seen += 1
            if name in families or name.endswith("_ADAPTIVE"):
                generic.append(f"{name}@{at}")
        at += 2 + 2 * caches[dis._deoptop(op)]
    return (f"{seen - len(generic)}/{seen}" + (f" ({instrumented} instrumented)" if instrumented else "")
            + "".join(f" {g}" for g in generic[:8]))


def process_fingerprint() -> dict:
    """What of this process may make the same Python frames cost more, as flat name -> value (compared side by
    side by ``one_gpu_truth.process_text``): its threads, collector, interpreter settings and monitoring tools,
    torch's modes, hooks and threads, its CPUs and scheduling, the environment that steers torch and the
    allocators, and the modules loaded (names under "modules")."""
    import gc
    import threading

    out: dict = {}

    def put(name, get):
        try:
            out[name] = get()
        except Exception as e:  # an attribute a version lacks: say so rather than stop the probe
            out[name] = f"? {type(e).__name__}"

    put("threads", lambda: sorted(t.name for t in threading.enumerate()))
    put("os_threads", lambda: len(os.listdir("/proc/self/task")))
    put("gc.enabled", gc.isenabled)
    put("gc.threshold", gc.get_threshold)
    put("gc.objects", lambda: len(gc.get_objects()))
    put("gc.frozen", gc.get_freeze_count)
    put("sys.switchinterval", sys.getswitchinterval)
    put("sys.flags", lambda: str(sys.flags))
    put("sys.xoptions", lambda: dict(sys._xoptions))
    put("sys.trace", lambda: repr(sys.gettrace()))
    put("sys.recursionlimit", sys.getrecursionlimit)
    put("sys.monitoring", lambda: [sys.monitoring.get_tool(i) for i in range(6)])
    put("modules.count", lambda: len(sys.modules))
    put("modules", lambda: sorted(sys.modules))
    put("affinity", lambda: len(os.sched_getaffinity(0)))
    put("scheduler", lambda: (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)))
    put("env", lambda: {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)})
    put("thp", lambda: _read("/sys/kernel/mm/transparent_hugepage/enabled"))
    put("memory_mib", _memory)
    import torch

    put("torch.function_modes", torch._C._len_torch_function_stack)
    put("torch.dispatch_modes", torch._C._len_torch_dispatch_stack)
    put("torch.profiler", lambda: torch.autograd.profiler._is_profiler_enabled)
    put("torch.anomaly", torch.is_anomaly_enabled)
    put("torch.grad", torch.is_grad_enabled)
    put("torch.deterministic", torch.are_deterministic_algorithms_enabled)
    put("torch.threads", lambda: (torch.get_num_threads(), torch.get_num_interop_threads()))
    put("torch.saved_tensor_hooks", lambda: repr(torch._C._autograd._top_saved_tensors_default_hooks(True)))
    put("torch.dynamo.callback", _dynamo_callback)
    return out


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _memory() -> dict:
    """The process's resident memory and how much of its anonymous memory huge pages back (MiB; smaps_rollup): a
    heap in small pages costs its every access more translation than one in huge pages."""
    out = {}
    for line in _read("/proc/self/smaps_rollup").splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Anonymous", "AnonHugePages"):
            out[name] = int(rest.split()[0]) // 1024
    return out


_COMPILED = None


def _compiled():
    """A small function through ``torch.compile`` (compiled at its first call): the canary's way into the
    compiled-call path (Inductor's output code and its runtime wrappers) outside the forward."""
    global _COMPILED
    if _COMPILED is None:
        import torch

        def scale(x):
            return x * 2 + 1

        _COMPILED = torch.compile(scale)
    return _COMPILED


def _dynamo_callback() -> str:
    """The frame callback dynamo has set on this thread: "none" (frames run as plain Python), "run-only" (compiled
    frames run, none are compiled) or the callback's type (frames are compiled)."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:
        return "-"
    cb = get_eval_frame_callback()
    return "none" if cb is None else "run-only" if cb is False else type(cb).__name__


class _Wrapped:
    """A marker sink whose forward spans the probe sees; everything passes through."""

    def __init__(self, sink, probe: _Probe) -> None:
        self.sink = sink
        self.probe = probe

    def record_mark(self, name, phase, attrs) -> None:
        if name == "forward" and phase == "E":
            self.probe.end()
        self.sink.record_mark(name, phase, attrs)
        if name == "forward" and phase == "B":
            self.probe.begin()


if _DIR:
    if _MODE not in MODES:
        raise SystemExit(f"FORWARD_PROBE={_MODE!r}: expected one of {', '.join(MODES)}")
    os.makedirs(_DIR, exist_ok=True)
    try:
        from prism_megatron.trace import markers as _markers
    except ImportError:
        _markers = None
    if _markers is not None:
        _probe = _Probe(int(os.environ.get("FORWARD_PROBE_SKIP", "24")))
        _original = _markers.set_sink

        def set_sink(sink):
            return _original(sink if sink is None or isinstance(sink, _Wrapped) else _Wrapped(sink, _probe))

        _markers.set_sink = set_sink
