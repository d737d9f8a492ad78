"""Which classes and module namespaces a process changes while it runs (bench only, CPython 3.11-3.12).

The interpreter specialises an attribute read on a class's version tag and a global's or a module attribute's
read on its namespace's keys version: a class assigned to, or a module namespace that gains or loses a name,
invalidates every such cache that rests on it, and code that keeps meeting one runs its generic, slower path.
A process that changes a class (or a name in ``torch``'s namespace) at every step slows every frame that reads
through it, which is how the same Python frames can cost more in one process than in another (docs/measurements.md,
"Each function's own time"). :class:`Census` takes each class's tag and each module's keys version; a later
:meth:`Census.changed` names what changed since, and :func:`unversioned` the classes that hold no tag at all.

Tags are read with ``_testcapi`` where the interpreter has it, else from the type object at the 64-bit offset
that CPython 3.11 and 3.12 use, checked at first use on a class this module changes itself; where neither works
the census says so rather than guess.
"""

from __future__ import annotations

import ctypes
import sys
import types

#: where ``tp_version_tag`` and a dict's keys version lie in CPython 3.11-3.12 on 64-bit (checked by ``_reader``)
TYPE_TAG_OFFSET = 384
DICT_KEYS_OFFSET = 32
KEYS_VERSION_OFFSET = 12


def _lookup(cls: type) -> None:
    """An attribute lookup on the class, which gives it a version tag if it can hold one."""
    try:
        getattr(cls, "__prism_census__", None)
    except Exception:  # a metaclass's __getattr__ that refuses: the class keeps whatever tag it had
        pass


def _reader():
    """A function class -> its version tag after a lookup, or None where this interpreter's tags cannot be read."""
    try:
        import _testcapi

        def tag(cls: type) -> int:
            _lookup(cls)
            return _testcapi.type_get_version(cls)
    except (ImportError, AttributeError):
        if sys.implementation.name != "cpython" or sys.version_info[:2] not in ((3, 11), (3, 12)) \
                or ctypes.sizeof(ctypes.c_void_p) != 8:
            return None

        def tag(cls: type) -> int:
            _lookup(cls)
            return ctypes.c_uint.from_address(id(cls) + TYPE_TAG_OFFSET).value
    probe = type("Probe", (), {})
    before = tag(probe)
    probe.changed = True
    after = tag(probe)
    return tag if before and after and before != after else None


def _keys_version(namespace: dict) -> tuple[int, int]:
    """A dict's keys object and its version (0 until a specialised read asks for one; a new name resets it)."""
    keys = ctypes.c_void_p.from_address(id(namespace) + DICT_KEYS_OFFSET).value or 0
    return keys, ctypes.c_uint32.from_address(keys + KEYS_VERSION_OFFSET).value if keys else 0


def all_classes() -> list[type]:
    """Every class alive, reached through ``__subclasses__`` from ``object``."""
    seen: set[int] = set()
    out: list[type] = []
    stack: list[type] = [object]
    while stack:
        cls = stack.pop()
        if id(cls) in seen:
            continue
        seen.add(id(cls))
        out.append(cls)
        try:
            stack.extend(type.__subclasses__(cls))
        except TypeError:
            pass
    return out


def class_name(cls: type) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls.__name__)}"


class Census:
    """Each class's version tag and each module's keys version at one moment."""

    def __init__(self) -> None:
        self.tag = _reader()
        self.classes = all_classes()
        self.tags = [self.tag(c) for c in self.classes] if self.tag is not None else []
        self.modules = {name: (m, _keys_version(m.__dict__)) for name, m in list(sys.modules.items())
                        if isinstance(m, types.ModuleType)}

    @property
    def readable(self) -> bool:
        return self.tag is not None

    def changed(self) -> dict[str, list[str]]:
        """The classes whose tag changed since (a tag of 0 then is none to compare) and the modules whose
        namespace was given another keys object or lost a keys version it had (a name added or removed)."""
        classes = [class_name(c) for c, t in zip(self.classes, self.tags, strict=True) if t and self.tag(c) != t]
        modules = []
        for name, (m, (keys, version)) in self.modules.items():
            now_keys, now_version = _keys_version(m.__dict__)
            if now_keys != keys or (version and now_version != version):
                modules.append(name)
        return {"classes": sorted(classes), "modules": sorted(modules)}

    def unversioned(self) -> list[str]:
        """The classes that hold no version tag even after a lookup: every cached read through them fails."""
        return sorted(class_name(c) for c, t in zip(self.classes, self.tags, strict=True) if not t)
