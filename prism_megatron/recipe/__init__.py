"""Recipes: versioned YAML descriptions of a target Megatron job, validated before anything starts.

Load one with :func:`load_recipe` (a shipped name such as ``mini-dense-tp2pp2`` or a path), turn it
into Megatron-LM flags with :func:`render_args`, or get the text of ``recipe show`` with :func:`show`.
"""

from .load import RECIPES_DIR, find_recipe, load_file, load_recipe, parse_recipe, recipe_files, recipe_names
from .render import (
    estimate_parameters,
    format_args,
    padded_vocab_size,
    render_args,
    render_env,
    show,
    summary,
)
from .schema import (
    SUPPORTED_VERSIONS,
    ModelSpec,
    MoeSpec,
    ParallelSpec,
    Recipe,
    RecipeError,
    TargetSpec,
    TrainingSpec,
    from_dict,
    to_dict,
    validate,
)

__all__ = [
    "RECIPES_DIR",
    "SUPPORTED_VERSIONS",
    "ModelSpec",
    "MoeSpec",
    "ParallelSpec",
    "Recipe",
    "RecipeError",
    "TargetSpec",
    "TrainingSpec",
    "estimate_parameters",
    "find_recipe",
    "format_args",
    "from_dict",
    "load_file",
    "load_recipe",
    "padded_vocab_size",
    "parse_recipe",
    "recipe_files",
    "recipe_names",
    "render_args",
    "render_env",
    "show",
    "summary",
    "to_dict",
    "validate",
]
