"""The fold of a trace: which ranks ran for real and whom every other rank mirrors.

A folded job runs only its *live* ranks; every virtual rank r mirrors its representative
``rep[r]`` (a live rank of the same class), shifted into r's own replica by ``r - rep[r]``. The
runtime records the fold plan in the manifest's job key ``"fold"`` (the plan's JSON plus
``"contributions"``: per op kind, how many virtual contributions were mirrored, recorded or kept);
the ops/marks/slots/gpu tables then hold live ranks' rows only, while the manifest's groups keep
their full rank lists. Replay and reports read the fold through :func:`read_fold`, which checks it
as strictly as the rest of the trace (errors name the file and the field).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .schema import MANIFEST_FILE, TraceFormatError

#: Fold plan versions this reader understands (2 adds ``depth``, ``axes``, ``sizes``, ``coords``).
FOLD_VERSIONS: tuple[int, ...] = (1, 2)
#: How a virtual member's input to an op was made (the contract's three ways).
CONTRIBUTION_WAYS: tuple[str, ...] = ("mirror", "recorded", "keep")


@dataclass(frozen=True)
class FoldClass:
    """Ranks that do the same work on the same shapes; ``sandbox``: its live ranks."""

    name: str
    role: str
    count: int
    sandbox: tuple[int, ...]
    coords: Any = None


@dataclass(frozen=True)
class Fold:
    """A fold plan as replay and reports need it (see the module docstring)."""

    world_size: int
    live: tuple[int, ...]
    rep: tuple[int, ...]
    gpus_per_node: int
    classes: tuple[FoldClass, ...] = ()
    class_of: tuple[int, ...] = ()
    contributions: dict[str, dict[str, int]] = field(default_factory=dict, hash=False, compare=False)

    def shift(self, rank: int) -> int:
        """How far rank ``rank``'s replica is from its representative's: ``rank - rep[rank]``."""
        return rank - self.rep[rank]

    def class_name(self, rank: int) -> str:
        return self.classes[self.class_of[rank]].name if self.classes else f"like rank {self.rep[rank]}"

    def contribution_counts(self) -> dict[str, int]:
        """Virtual contributions by way (mirror, recorded, keep), summed over op kinds."""
        out = dict.fromkeys(CONTRIBUTION_WAYS, 0)
        for ways in self.contributions.values():
            for way, n in ways.items():
                out[way] = out.get(way, 0) + n
        return out

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``job.fold`` value for this fold (what the runtime writes)."""
        return {"version": 1, "world_size": self.world_size, "live": list(self.live),  # no coords: version 1
                "rep": list(self.rep), "gpus_per_node": self.gpus_per_node,
                "classes": [{"name": c.name, "role": c.role, "count": c.count, "sandbox": list(c.sandbox),
                             "coords": c.coords} for c in self.classes],
                "class_of": list(self.class_of), "contributions": self.contributions}


def make_fold(rep: Sequence[int], gpus_per_node: int, classes: Sequence[FoldClass] = (),
              class_of: Sequence[int] = (), contributions: dict[str, dict[str, int]] | None = None) -> Fold:
    """A checked Fold from a rep list; without ``classes``, one class per live rank (the ranks it stands for)."""
    rep = tuple(int(x) for x in rep)
    live = tuple(sorted(set(rep)))
    if not classes:
        index = {x: i for i, x in enumerate(live)}
        counts = [0] * len(live)
        for x in rep:
            counts[index[x]] += 1
        classes = tuple(FoldClass(f"like rank {x}", "", counts[i], (x,)) for i, x in enumerate(live))
        class_of = tuple(index[x] for x in rep)
    fold = Fold(len(rep), live, rep, int(gpus_per_node), tuple(classes), tuple(class_of), dict(contributions or {}))
    return parse_fold(fold.to_json(), len(rep), "<fold>")


def _error(path: str | Path, key: str, problem: str) -> TraceFormatError:
    return TraceFormatError(path, f"manifest field 'job.fold.{key}'", problem)


def _int_list(doc: dict, key: str, path: str | Path) -> list[int]:
    value = doc.get(key)
    if not isinstance(value, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in value):
        raise _error(path, key, "is missing or not a list of integers")
    return value


def _int(doc: dict, key: str, path: str | Path, minimum: int = 1) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _error(path, key, f"is {value!r}, expected an integer >= {minimum}")
    return value


def parse_fold(doc: Any, world_size: int, path: str | Path) -> Fold:
    """Check a ``job.fold`` value against the trace's ``world_size``; raise TraceFormatError naming the field."""
    if not isinstance(doc, dict):
        raise TraceFormatError(path, "manifest field 'job.fold'", f"is {type(doc).__name__}, expected an object")
    version = doc.get("version")
    if version not in FOLD_VERSIONS or isinstance(version, bool):
        raise _error(path, "version", f"is {version!r}; this reader supports fold plan version(s) "
                                      f"{', '.join(map(str, FOLD_VERSIONS))}")
    w = _int(doc, "world_size", path)
    if w != world_size:
        raise _error(path, "world_size", f"is {w}, but the trace's world_size is {world_size}")
    live, rep = _int_list(doc, "live", path), _int_list(doc, "rep", path)
    if not live or live != sorted(set(live)) or live[0] < 0 or live[-1] >= w:
        raise _error(path, "live", f"is {live[:8]}{'...' if len(live) > 8 else ''}: expected sorted distinct "
                                   f"ranks in [0, {w})")
    if len(rep) != w:
        raise _error(path, "rep", f"has {len(rep)} entries, expected one per rank ({w})")
    live_set = set(live)
    for r, x in enumerate(rep):
        if x not in live_set:
            raise _error(path, "rep", f"maps rank {r} to {x}, which is not a live rank")
        if r in live_set and x != r:
            raise _error(path, "rep", f"maps live rank {r} to {x}; a live rank represents itself")
    gpus = _int(doc, "gpus_per_node", path)
    raw_classes = doc.get("classes", [])
    if not isinstance(raw_classes, list):
        raise _error(path, "classes", "is not a list")
    classes = []
    for i, c in enumerate(raw_classes):
        key = f"classes[{i}]"
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not isinstance(c.get("role", ""), str):
            raise _error(path, key, "is not an object with a string 'name' (and 'role')")
        count = _int(c, "count", path)
        sandbox = _int_list(c, "sandbox", path)
        if not sandbox or not set(sandbox) <= live_set:
            raise _error(path, f"{key}.sandbox", f"is {sandbox}: expected live ranks")
        classes.append(FoldClass(c["name"], c.get("role", ""), count, tuple(sandbox), c.get("coords")))
    class_of: list[int] = []
    if classes:
        class_of = _int_list(doc, "class_of", path)
        if len(class_of) != w or any(not 0 <= k < len(classes) for k in class_of):
            raise _error(path, "class_of", f"must hold {w} indices into classes (0..{len(classes) - 1})")
        counts = [0] * len(classes)
        for k in class_of:
            counts[k] += 1
        for i, (c, n) in enumerate(zip(classes, counts, strict=True)):
            if c.count != n:
                raise _error(path, f"classes[{i}].count", f"is {c.count}, but class_of gives class {c.name!r} "
                                                          f"{n} rank(s)")
    contributions = doc.get("contributions", {})
    if not isinstance(contributions, dict) or any(
            not isinstance(v, dict) or any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in v.values())
            for v in contributions.values()):
        raise _error(path, "contributions", "is not an object of {op kind: {mirror|recorded|keep: count}}")
    return Fold(w, tuple(live), tuple(rep), gpus, tuple(classes), tuple(class_of), contributions)


def read_fold(manifest: dict[str, Any], trace_dir: str | Path = "<trace>") -> Fold | None:
    """The fold of a trace's manifest, None when the trace is not folded (every rank ran)."""
    job = manifest.get("job") or {}
    if not isinstance(job, dict) or job.get("fold") is None:
        return None
    return parse_fold(job["fold"], int(manifest["world_size"]), Path(trace_dir) / MANIFEST_FILE)
