"""Find recipes by name and read recipe files, turning every YAML slip into a named error.

Shipped recipes are package data (``prism_megatron/recipes``, :data:`prism_megatron.recipes.ROOT`),
named ``<folder>-<file stem>``: ``recipes/mini/dense-tp2pp2.yaml`` is ``mini-dense-tp2pp2``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from prism_megatron.recipes import ROOT as RECIPES_DIR

from .schema import Recipe, RecipeError, from_dict


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys: plain PyYAML keeps the last one, silently."""


def _mapping_no_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key].start_mark.line + 1})", mark)
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_no_duplicates)


def display_path(path: Path) -> str:
    """A path as users should see it in messages: relative to the working directory or the package."""
    path = Path(path)
    resolved = path.resolve()
    for base in (Path.cwd(), RECIPES_DIR.parent):
        try:
            return str(resolved.relative_to(base.resolve()))
        except ValueError:
            continue
    return str(path)


def parse_recipe(text: str, source: str = "<string>") -> Recipe:
    """Parse YAML text and validate it; errors name ``source`` and the line or field."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "(yaml)"
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        msg = f"invalid YAML: {problem}" + (f" ({context})" if context else "")
        raise RecipeError(source, [(where, msg)]) from None
    if data is None:
        raise RecipeError(source, [("(top level)", "the file is empty")])
    return from_dict(data, source)


def load_file(path: str | os.PathLike[str]) -> Recipe:
    """Read and validate one recipe file."""
    path = Path(path)
    source = display_path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecipeError(source, [("(file)", f"cannot read: {exc.strerror or exc}")]) from None
    return parse_recipe(text, source)


def recipe_files(root: Path | None = None) -> list[Path]:
    """Every shipped recipe file, sorted."""
    root = RECIPES_DIR if root is None else Path(root)
    return sorted(p for p in root.rglob("*.yaml") if p.is_file() and p.relative_to(root).parts[0] != "clusters")


def name_of(path: Path, root: Path | None = None) -> str:
    """The name a shipped recipe file must carry: its folders and stem joined by '-'."""
    root = RECIPES_DIR if root is None else Path(root)
    rel = Path(path).resolve().relative_to(root.resolve()).with_suffix("")
    return "-".join(rel.parts)


def recipe_names(root: Path | None = None) -> list[str]:
    """Names of the shipped recipes, as accepted by :func:`load_recipe`."""
    return [name_of(p, root) for p in recipe_files(root)]


def find_recipe(name_or_path: str | os.PathLike[str], root: Path | None = None) -> Path:
    """Resolve a recipe name (``mini-dense-tp2pp2``, ``mini/dense-tp2pp2`` or a unique stem) or a path."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or candidate.is_file():
        if candidate.is_file():
            return candidate
        raise RecipeError(str(name_or_path), [("(file)", "no such file")])
    key = str(name_or_path)
    root = RECIPES_DIR if root is None else Path(root)
    files = recipe_files(root)
    exact = [p for p in files if key in (name_of(p, root), p.relative_to(root).with_suffix("").as_posix())]
    if exact:
        return exact[0]
    by_stem = [p for p in files if p.stem == key]
    if len(by_stem) == 1:
        return by_stem[0]
    if by_stem:
        options = ", ".join(name_of(p, root) for p in by_stem)
        raise RecipeError(key, [("(name)", f"ambiguous; one of: {options}")])
    known = ", ".join(name_of(p, root) for p in files) or "(none)"
    raise RecipeError(key, [("(name)", f"no recipe of that name or file; shipped recipes: {known}")])


def load_recipe(name_or_path: str | os.PathLike[str]) -> Recipe:
    """Find (by name or path) and validate a recipe."""
    return load_file(find_recipe(name_or_path))
