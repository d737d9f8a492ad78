"""The project's dependency rules, checked by static import analysis of the source (ast: every
``import``, including those inside functions, and ``importlib.import_module("...")`` with a literal).

- the runtime imports no Megatron, directly or through the package modules it imports;
- the trace format imports neither the runtime nor Megatron (directly or through what it imports);
- nothing imports the CLI (``prism_megatron.cli`` only parses, validates and calls; ``__main__`` runs it);
- ``nccl_prune`` (when present) imports no Megatron, directly or through what it imports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("prism_megatron", "nccl_prune")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> set[str]:
    """Absolute names of every module ``path`` imports (``from a import b`` yields a and a.b)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{alias.name}" for alias in node.names if alias.name != "*")
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and not node.args[0].value.startswith(".")
              and (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
                   or isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))):
            out.add(node.args[0].value)
    return out


def import_graph(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """module -> the modules it imports, for every source file of ``packages`` under ``root``."""
    graph = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            module = _module_name(path, root)
            graph[module] = _imports(path, module)
    return graph


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _reachable(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module reachable from ``start`` through the graph's own modules -> the import chain to it."""
    chains = {start: [start]}
    todo = [start]
    while todo:
        module = todo.pop()
        for name in graph.get(module, ()):
            # `from pkg import mod` names pkg.mod, which may be a module of the graph or an attribute
            target = name if name in graph else name.rpartition(".")[0] if name.rpartition(".")[0] in graph else name
            if target not in chains:
                chains[target] = chains[module] + [target]
                if target in graph:
                    todo.append(target)
    return chains


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Each broken rule, as 'module: rule (import chain)'."""
    rules = [  # (modules the rule covers, forbidden module prefixes, rule)
        ("prism_megatron.runtime", ("megatron",), "the runtime imports no Megatron"),
        ("prism_megatron.trace", ("megatron", "prism_megatron.runtime"),
         "the trace imports neither runtime nor Megatron"),
        ("nccl_prune", ("megatron",), "nccl_prune imports no Megatron"),
    ]
    out = []
    for scope, forbidden, rule in rules:
        for module in sorted(m for m in graph if _within(m, scope)):
            for reached, chain in sorted(_reachable(graph, module).items()):
                if any(_within(reached, f) for f in forbidden):
                    out.append(f"{module}: {rule} ({' -> '.join(chain)})")
                    break
    for module, names in sorted(graph.items()):
        if module != "prism_megatron.__main__" and any(_within(n, "prism_megatron.cli") for n in names):
            out.append(f"{module}: nothing imports the CLI (prism_megatron.cli)")
    return out


def test_the_package_keeps_the_dependency_rules():
    graph = import_graph(ROOT)
    assert any(_within(m, "prism_megatron.runtime") for m in graph) and any(_within(m, "prism_megatron.trace")
                                                                           for m in graph)
    assert violations(graph) == []


def test_nccl_prune_imports_no_megatron():
    if not (ROOT / "nccl_prune").is_dir():
        pytest.skip("nccl_prune/ does not exist in this tree yet")
    graph = import_graph(ROOT, ["nccl_prune", "prism_megatron"])
    assert any(_within(m, "nccl_prune") for m in graph)
    assert [v for v in violations(graph) if v.startswith("nccl_prune")] == []


def test_the_checker_finds_a_function_level_import_through_a_chain(tmp_path):
    """A forbidden import hidden in a function of a module the runtime imports is found, as is a CLI import."""
    pkg = tmp_path / "prism_megatron"
    for sub in ("runtime", "trace", "report"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("")
    (pkg / "runtime" / "client.py").write_text("from ..report import helper\n")
    (pkg / "report" / "helper.py").write_text("def f():\n    from megatron.core import parallel_state\n")
    (pkg / "trace" / "reader.py").write_text("import importlib\nimportlib.import_module('prism_megatron.runtime')\n")
    (pkg / "report" / "build.py").write_text("def g():\n    from prism_megatron import cli\n")
    found = violations(import_graph(tmp_path, ["prism_megatron"]))
    assert found == [
        "prism_megatron.runtime.client: the runtime imports no Megatron (prism_megatron.runtime.client -> "
        "prism_megatron.report.helper -> megatron.core)",
        "prism_megatron.trace.reader: the trace imports neither runtime nor Megatron (prism_megatron.trace.reader "
        "-> prism_megatron.runtime)",
        "prism_megatron.report.build: nothing imports the CLI (prism_megatron.cli)",
    ]
