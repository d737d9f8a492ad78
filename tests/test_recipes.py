"""Recipes: shipped files validate, every rule rejects with the field named, and the rendered flags
are what Megatron itself accepts.

Agreement with Megatron is checked against the real code, not a copy of its rules:
- always: megatron-core 0.16.1's TransformerConfig, get_num_layers_to_build, the microbatch
  calculator, and parallel_state.initialize_model_parallel on torch's in-process "fake" backend
  (the target world size in one process, no communication);
- when a Megatron-LM checkout (tag core_v0.16.1) is found: Megatron-LM's own parser, validate_args
  and core_transformer_config_from_args (megatron/training/arguments.py; the megatron-core wheel
  does not ship megatron/training). Point MEGATRON_LM_PATH at the checkout; set
  PRISM_REQUIRE_MEGATRON_LM=1 to fail instead of skip when it is absent.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import os
import re
import shlex
import sys
import types
import warnings
from pathlib import Path

import pytest
import yaml

from prism_megatron.recipe import (
    RECIPES_DIR,
    Recipe,
    RecipeError,
    estimate_parameters,
    find_recipe,
    format_args,
    from_dict,
    load_file,
    load_recipe,
    padded_vocab_size,
    parse_recipe,
    recipe_files,
    recipe_names,
    render_args,
    render_env,
    schema,
    show,
    to_dict,
    validate,
)
from prism_megatron.recipe.load import name_of
from prism_megatron.recipe.schema import RECIPE_FLAGS

pytestmark = pytest.mark.megatron  # runs megatron-core: CI also runs it on the second stack (.ci/run)

REPO = Path(__file__).resolve().parents[1]

SHIPPED = {
    # name: (world size, layout, EP, VPP)
    "mini-dense-tp2pp2": (4, "TP2xPP2xCP1xDP1", 1, None),
    "mini-dense-tp2dp2-distopt": (4, "TP2xPP1xCP1xDP2", 1, None),
    "mini-dense-pp2vpp2": (4, "TP1xPP2xCP1xDP2", 1, 2),
    "mini-dense-tp2-sp": (4, "TP2xPP1xCP1xDP2", 1, None),
    "mini-dense-cp2": (4, "TP1xPP1xCP2xDP2", 1, None),
    "mini-dense-tp2pp2dp2": (8, "TP2xPP2xCP1xDP2", 1, None),
    "mini-dense-tp2pp2dp4": (16, "TP2xPP2xCP1xDP4", 1, None),
    "mini-moe-ep2": (4, "TP1xPP1xCP1xDP4", 2, None),
    "mini-moe-ep4-tp1pp2": (8, "TP1xPP2xCP1xDP4", 4, None),
}

# A valid recipe that the bad-recipe table mutates one rule at a time.
DENSE = {
    "version": 1,
    "name": "t-dense",
    "description": "test",
    "model": {"kind": "gpt", "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 256,
              "num_attention_heads": 4, "num_query_groups": None, "seq_length": 64,
              "max_position_embeddings": 64, "vocab_size": 1024, "moe": None},
    "parallel": {"tp": 2, "pp": 2, "vpp": None, "cp": 1, "ep": 1, "etp": None, "dp": None,
                 "sequence_parallel": False, "distributed_optimizer": False,
                 "overlap_grad_reduce": False, "overlap_param_gather": False},
    "training": {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 3, "lr": 1.0e-4,
                 "seed": 1234, "precision": "fp32", "optimizer": "adam"},
    "world_size": 4,
    "target": {"gpu": None, "cluster": None},
    "extra_args": [],
}
MOE = copy.deepcopy(DENSE)
MOE["name"] = "t-moe"
MOE["model"]["moe"] = {"num_experts": 4, "router_topk": 2, "token_dispatcher": "alltoall",
                       "ffn_hidden_size": 128, "aux_loss_coeff": 0.0}
MOE["parallel"].update(tp=1, pp=1, ep=2)

DELETE = object()


def mutate(base: dict, changes: dict) -> dict:
    """Copy of ``base`` with dotted keys set (or removed with DELETE)."""
    data = copy.deepcopy(base)
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = data
        for key in parents:
            node = node[key]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
    return data


def problems_of(data: dict) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        validate_dict(data)
    return info.value


def validate_dict(data: dict) -> Recipe:
    return from_dict(data, "t.yaml")


def assert_problem(err: RecipeError, field: str, fragment: str) -> None:
    hits = [msg for where, msg in err.problems if where == field]
    assert hits, f"no problem reported for {field}; got {err.problems}"
    assert any(fragment in msg for msg in hits), f"{field}: {hits} lacks {fragment!r}"


# --- shipped recipes ---------------------------------------------------------------------------


TARGETS = {
    # name: (world size, TP, PP, VPP, CP, EP)
    "targets-llama3-8b-h100x8": (8, 1, 1, None, 1, 1),
    "targets-llama3-70b-h100x64": (64, 4, 4, 5, 1, 1),
    "targets-llama31-405b-h100x512": (512, 8, 8, 8, 1, 1),
    "targets-llama31-405b-h100x8192": (8192, 8, 8, 8, 1, 1),
    "targets-qwen3-30b-a3b-h100x16": (16, 1, 1, None, 1, 16),
    "targets-qwen3-235b-a22b-h100x256-tp2pp8vpp4ep32": (256, 2, 8, 4, 1, 32),
    "targets-qwen3-235b-a22b-h100x256-tp1pp8vpp4ep8": (256, 1, 8, 4, 1, 8),
    "targets-qwen3-235b-a22b-h100x256-tp1pp8ep32": (256, 1, 8, None, 1, 32),
    "targets-deepseek-v3-h100x1024": (1024, 2, 8, 4, 1, 64),
}


def test_shipped_recipe_set():
    assert sorted(recipe_names()) == sorted([*SHIPPED, *TARGETS])
    assert RECIPES_DIR == REPO / "prism_megatron" / "recipes"


def _field(recipe: Recipe, dotted: str):
    node = recipe
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_target_recipe_provenance_and_substitutions(name):
    """Every target names its sources (full commits) and the GPU, cluster and node size it targets;
    a substitution of a recipe field states the value the recipe really renders."""
    from prism_megatron.calibration.profiles import load_profile
    from prism_megatron.memory.targets import resolve_target

    recipe = load_recipe(name)
    p = recipe.parallel
    assert (recipe.world_size, p.tp, p.pp, p.vpp, p.cp, p.ep) == TARGETS[name]
    assert recipe.version == 3 and recipe.sources and recipe.emulation.chosen()
    assert all(re.fullmatch(r"[0-9a-f]{40}", s.commit) for s in recipe.sources)
    assert recipe.target.gpus_per_node == load_profile(recipe.target.cluster).node_size == 8
    assert resolve_target(recipe.target.gpu).capacity > 70 * 2**30
    # Nothing the emulation machine lacks may be rendered; each such setting is a named substitution.
    assert recipe.model.transformer_impl == "local"
    assert "model.transformer_impl" in {s.setting for s in recipe.substitutions}
    for sub in recipe.substitutions:
        if sub.setting.startswith("--"):
            assert sub.setting.split()[0] not in render_args(recipe), f"{name}: {sub.setting} is rendered"
        elif sub.setting.split(".")[0] in ("model", "parallel", "training", "target"):
            value = _field(recipe, sub.setting)
            text = str(value).lower() if isinstance(value, bool) else str(value)  # as YAML writes it
            assert text == sub.rendered, f"{name}: {sub.setting}"
    assert validate(recipe) == recipe


def test_target_show_lists_sources_and_substitutions():
    text = show("targets-deepseek-v3-h100x1024")
    assert re.search(r"sources\s+layout .*NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/perf_recipes/deepseek", text)
    assert "parallel.pipeline_layout: published Et|(tt|)*30mL" in text
    assert "1024 GPUs" in text and "8 GPUs per node" in text and "not estimated" in text
    assert "recompute selective (mla_up_proj, mlp)" in text
    assert re.search(r"emulation\s+--prism-attention sdpa --prism-experts grouped --prism-optimizer fused "
                     r"--prism-fold-capture serial --prism-fold-microbatches auto", text)
    assert "emulation " not in show("mini-dense-tp2pp2")  # a recipe that chooses none says nothing of it
    args = render_args(load_recipe("targets-deepseek-v3-h100x1024"))
    assert flag_values(args, "--pipeline-model-parallel-layout") == ["Et|(tt|)*30L"]
    assert "--num-virtual-stages-per-pipeline-rank" not in args
    assert flag_values(args, "--recompute-modules") == ["mla_up_proj", "mlp"]
    # Megatron pads the vocabulary to a multiple of divisor x TP: 151,936 = 1187 x 128 stays whole at TP2
    assert padded_vocab_size(load_recipe("targets-qwen3-235b-a22b-h100x256-tp2pp8vpp4ep32")) == 151_936
    assert padded_vocab_size(load_recipe("targets-llama31-405b-h100x512")) == 129_024  # 128 x TP8 = 1024
    llama = render_args(load_recipe("targets-llama31-405b-h100x512"))
    assert {"--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"} <= set(llama)


V2 = mutate(DENSE, {"version": 2})


@pytest.mark.parametrize(("changes", "field", "fragment"), [
    ({"version": 1, "target.gpus_per_node": 8}, "target.gpus_per_node", "needs version: 2"),
    ({"version": 1, "sources": []}, "sources", "needs version: 2"),
    ({"version": 1, "parallel.pipeline_layout": "Et|tL"}, "parallel.pipeline_layout", "needs version: 2"),
    ({"sources": [{"what": "x", "repository": "a/b", "path": "p", "commit": "abc"}]}, "sources[0].commit",
     "40 lower-case hex"),
    ({"sources": [{"what": "x", "repository": "a/b", "path": "p", "commit": "a" * 40, "sha": 1}]},
     "sources[0].sha", "unknown key"),
    ({"substitutions": [{"setting": "x", "published": "y"}]}, "substitutions[0].rendered", "required key"),
    ({"substitutions": "none"}, "substitutions", "list of mappings"),
    ({"parallel.pipeline_layout": "Et|t|t|tL"}, "parallel.vpp", "has 4 stages over parallel.pp=2: VPP must be"),
    ({"parallel.pipeline_layout": "Et|tL", "parallel.account_for_loss_in_pipeline_split": True},
     "parallel.pipeline_layout", "already places"),
    ({"parallel.pipeline_layout": "((("}, "parallel.pipeline_layout", "not a layout string"),
    ({"model.num_layers": 6, "parallel.account_for_embedding_in_pipeline_split": True}, "parallel.pp",
     "+ 1 (embedding/loss counted as layers)"),
    ({"training.recompute": {"granularity": "full"}}, "training.recompute", "needs method"),
    ({"training.recompute": {"granularity": "selective", "method": "block", "num_layers": 1}},
     "training.recompute", "takes no method"),
])
def test_v2_fields_rejected_with_field(changes, field, fragment):
    assert_problem(problems_of(mutate(V2, changes)), field, fragment)


V3 = mutate(DENSE, {"version": 3})


@pytest.mark.parametrize(("changes", "field", "fragment"), [
    ({"version": 2, "emulation": {"attention": "sdpa"}}, "emulation", "needs version: 3"),
    ({"emulation": {"attention": "flash"}}, "emulation.attention", "'flash' is not one of megatron, sdpa"),
    ({"emulation": {"devices": "0"}}, "emulation.devices", "unknown key"),
    ({"emulation": {"fold_capture": "serial", "fold": "off"}}, "emulation.fold_capture", "emulation.fold is off"),
    ({"emulation": {"fold_microbatches": "some"}}, "emulation.fold_microbatches", "'some' is not auto, off or a"),
    ({"emulation": {"fold_microbatches": 4}}, "emulation.fold_microbatches", "expected a string, got integer 4"),
    ({"emulation": "serial"}, "emulation", "expected a mapping"),
])
def test_v3_emulation_rejected_with_field(changes, field, fragment):
    assert_problem(problems_of(mutate(V3, changes)), field, fragment)


def test_v3_emulation_accepted_and_written_back():
    ok = validate_dict(mutate(V3, {"emulation": {"fold_microbatches": "4", "attention": "sdpa"}}))
    assert ok.emulation.chosen() == {"attention": "sdpa", "fold_microbatches": "4"}  # declaration order
    assert validate(ok) == ok
    assert "emulation" not in to_dict(validate_dict(V2))  # an older version's file never carries it
    assert validate_dict(V3).emulation.chosen() == {}


def _parse_target(tmp_path, *flags, name="targets-llama3-70b-h100x64"):
    from prism_megatron.megatron.run import parse_run_args

    script = tmp_path / "pretrain_gpt.py"  # a target recipe runs Megatron-LM's script
    script.write_text("")
    return parse_run_args(["--recipe", name, *flags, str(script)])


def test_run_takes_a_recipes_emulation_where_no_flag_gives_it(tmp_path):
    from prism_megatron.patches.attention import ENV_VAR as ATTENTION_ENV

    chosen = load_recipe("targets-llama3-70b-h100x64").emulation.chosen()
    assert chosen == {"attention": "sdpa", "optimizer": "fused", "fold_capture": "serial", "fold_microbatches": "auto"}
    request = _parse_target(tmp_path)
    assert {k: request.options["prism_" + k] for k in chosen} == chosen
    assert request.env[ATTENTION_ENV] == "sdpa"  # taken before the attention is rendered, with its substitution
    assert any(s["setting"].startswith("core attention") for s in request.substitutions)
    assert "prism: --prism-fold-capture serial (recipe targets-llama3-70b-h100x64's emulation.fold_capture)" \
        in request.notes
    flagged = _parse_target(tmp_path, "--prism-attention", "megatron", "--prism-fold-microbatches=off")
    assert (flagged.options["prism_attention"], flagged.options["prism_fold_microbatches"]) == ("megatron", "off")
    assert ATTENTION_ENV not in flagged.env and not any("emulation.attention" in n for n in flagged.notes)
    assert flagged.options["prism_fold_capture"] == "serial"  # the choices no flag gave still hold


def test_a_recipes_grouped_experts_render_its_grouped_gemm_and_yield_to_the_flag(tmp_path):
    """A recipe's emulation.experts grouped installs the seam and rewrites the recipe's own substitution
    for the target's --moe-grouped-gemm (the report names what rendered it); --prism-experts overrides it."""
    from prism_megatron.patches.grouped_experts import ENV_VAR as EXPERTS_ENV

    name = "targets-qwen3-30b-a3b-h100x16"
    request = _parse_target(tmp_path, name=name)
    assert request.options["prism_experts"] == "grouped" and request.env[EXPERTS_ENV] == "grouped"
    assert f"prism: --prism-experts grouped (recipe {name}'s emulation.experts)" in request.notes
    grouped_gemm = [s for s in request.substitutions if s["setting"] == "--moe-grouped-gemm"]
    assert len(grouped_gemm) == 1 and grouped_gemm[0]["rendered"].startswith("torch grouped_mm")
    flagged = _parse_target(tmp_path, "--prism-experts", "megatron", name=name)
    assert flagged.options["prism_experts"] == "megatron" and EXPERTS_ENV not in flagged.env
    sub = [s for s in flagged.substitutions if s["setting"] == "--moe-grouped-gemm"]
    assert sub[0]["rendered"].startswith("off (one GEMM per local expert")  # the recipe's own entry


@pytest.mark.parametrize(("flags", "dropped", "why"), [
    (("--prism-fold", "off"), ["fold_capture"], "--prism-fold off runs every rank together"),
    (("--prism-calibrate", "on"), ["fold_capture", "fold_microbatches"], "--prism-calibrate on re-runs"),
])
def test_a_recipes_emulation_yields_to_the_flags_that_rule_it_out(tmp_path, flags, dropped, why):
    from prism_megatron.options import RunOnlyOptions, option

    request = _parse_target(tmp_path, *flags)
    for name in dropped:
        assert request.options["prism_" + name] == option(RunOnlyOptions, name).default
        assert any(n.startswith(f"prism: recipe targets-llama3-70b-h100x64's emulation.{name} ") and why in n
                   for n in request.notes), request.notes
    assert request.options["prism_attention"] == "sdpa"


def test_v2_fields_accepted():
    ok = validate_dict(mutate(V2, {
        "model.num_layers": 6, "parallel.account_for_embedding_in_pipeline_split": True,
        "parallel.account_for_loss_in_pipeline_split": True, "parallel.vpp": 2,
        "training.recompute": {"granularity": "full", "method": "uniform", "num_layers": 1},
        "target.gpus_per_node": 8,
        "sources": [{"what": "x", "repository": "a/b", "path": "p", "commit": "a" * 40}]}))
    assert ok.sources[0].name is None and ok.training.recompute.modules == ()
    assert validate(ok) == ok
    layout = validate_dict(mutate(V2, {"parallel.pipeline_layout": "Et|t|t|tL", "parallel.vpp": 2}))
    assert flag_values(render_args(layout), "--pipeline-model-parallel-layout") == ["Et|t|t|tL"]


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_recipe_loads_and_validates(name):
    recipe = load_recipe(name)
    world, layout, ep, vpp = SHIPPED[name]
    assert recipe.name == name == name_of(find_recipe(name))
    got = (recipe.world_size, recipe.layout, recipe.parallel.ep, recipe.parallel.vpp)
    assert got == (world, layout, ep, vpp)
    assert 4 <= recipe.world_size <= 16
    m = recipe.model
    assert (m.hidden_size, m.seq_length, m.vocab_size, recipe.training.train_iters) == (64, 64, 1024, 3)
    assert 2 <= m.num_layers <= 8
    assert recipe.source.endswith(f"recipes/mini/{name.removeprefix('mini-')}.yaml")
    assert validate(recipe) == recipe  # round-trips through to_dict/from_dict


# --- bad recipes: every rule, with the field named ------------------------------------------------

BAD = [
    # id, base, changes, field at fault, message fragment
    ("version-kind", DENSE, {"model.kind": "bert"}, "model.kind", "not one of gpt"),
    ("name", DENSE, {"name": "Bad Name"}, "name", "lower-case"),
    ("positive-int", DENSE, {"parallel.tp": 0}, "parallel.tp", "positive integer"),
    ("negative-world", DENSE, {"world_size": -4}, "world_size", "positive integer"),
    ("int-not-str", DENSE, {"parallel.tp": "2"}, "parallel.tp", "expected a positive integer, got string"),
    ("int-not-bool", DENSE, {"parallel.pp": True}, "parallel.pp", "got boolean"),
    ("int-not-float", DENSE, {"model.num_layers": 4.0}, "model.num_layers", "got number"),
    ("seed", DENSE, {"training.seed": -1}, "training.seed", ">= 0"),
    ("lr-positive", DENSE, {"training.lr": 0}, "training.lr", "> 0"),
    ("lr-yaml-text", DENSE, {"training.lr": "1e-4"}, "training.lr", "write 1.0e-4"),
    ("bool", DENSE, {"parallel.sequence_parallel": "yes"}, "parallel.sequence_parallel", "true or false"),
    ("str", DENSE, {"target.gpu": 3}, "target.gpu", "expected a string"),
    ("section-type", DENSE, {"parallel": [1, 2]}, "parallel", "expected a mapping"),
    ("required", DENSE, {"model.num_layers": DELETE}, "model.num_layers", "required key is missing"),
    ("required-section", DENSE, {"training": DELETE}, "training", "required key is missing"),
    ("not-null", DENSE, {"parallel.tp": None}, "parallel.tp", "got null"),
    ("extra-args-list", DENSE, {"extra_args": "--foo"}, "extra_args", "list of strings"),
    ("extra-args-item", DENSE, {"extra_args": ["--log-interval", 1]}, "extra_args[1]", "quote it"),
    ("extra-args-owned", DENSE, {"extra_args": ["--tensor-model-parallel-size", "4"]}, "extra_args[0]",
     "parallel.tp"),
    ("extra-args-owned-eq", DENSE, {"extra_args": ["--seq-length=128"]}, "extra_args[0]", "model.seq_length"),
    ("precision", DENSE, {"training.precision": "fp8"}, "training.precision", "fp32, bf16, fp16"),
    ("optimizer", DENSE, {"training.optimizer": "muon"}, "training.optimizer", "not one of"),
    ("dispatcher", MOE, {"model.moe.token_dispatcher": "flex"}, "model.moe.token_dispatcher",
     "alltoall, allgather"),
    ("aux-loss", MOE, {"model.moe.aux_loss_coeff": -0.1}, "model.moe.aux_loss_coeff", ">= 0"),
    ("hidden-heads", DENSE, {"model.num_attention_heads": 3}, "model.num_attention_heads",
     "does not divide model.hidden_size=64"),
    ("heads-tp", DENSE, {"parallel.tp": 4, "parallel.pp": 1, "model.num_attention_heads": 2},
     "parallel.tp", "does not divide model.num_attention_heads=2"),
    ("groups-heads", DENSE, {"model.num_query_groups": 3}, "model.num_query_groups",
     "does not divide model.num_attention_heads=4"),
    ("groups-tp-local", DENSE, {"model.num_query_groups": 1}, "parallel.tp",
     "does not divide model.num_query_groups=1"),
    ("groups-tp-te", DENSE, {"model.transformer_impl": "transformer_engine", "parallel.tp": 4,
                             "parallel.pp": 1, "model.hidden_size": 96, "model.num_attention_heads": 12,
                             "model.num_query_groups": 6}, "parallel.tp", "neither divides the other"),
    ("ffn-tp", DENSE, {"model.ffn_hidden_size": 255}, "parallel.tp",
     "does not divide model.ffn_hidden_size=255"),
    ("max-positions", DENSE, {"model.max_position_embeddings": 32}, "model.max_position_embeddings",
     "smaller than model.seq_length=64"),
    ("world-divisible", DENSE, {"world_size": 6}, "world_size", "not divisible by TP*PP*CP"),
    ("world-dp", DENSE, {"parallel.dp": 2}, "parallel.dp", "but world_size is 4"),
    ("layers-pp", DENSE, {"model.num_layers": 3}, "parallel.pp", "does not divide model.num_layers=3"),
    ("vpp-one", DENSE, {"parallel.vpp": 1}, "parallel.vpp", "write null"),
    ("vpp-needs-pp", DENSE, {"parallel.pp": 1, "parallel.vpp": 2}, "parallel.vpp", "needs parallel.pp >= 2"),
    ("vpp-layers", DENSE, {"parallel.vpp": 4}, "parallel.vpp", "does not divide model.num_layers=4"),
    ("vpp-microbatches", DENSE, {"parallel.vpp": 2, "training.global_batch_size": 6},
     "training.global_batch_size", "positive multiple of parallel.pp=2"),
    ("cp-seq", DENSE, {"parallel.cp": 2, "parallel.pp": 1, "model.seq_length": 62,
                       "model.max_position_embeddings": 64, "model.transformer_impl": "transformer_engine"},
     "parallel.cp", "divisible by 2*CP = 4"),
    ("cp-local", DENSE, {"parallel.cp": 2, "parallel.pp": 1}, "parallel.cp", "transformer_engine"),
    ("sp-tp1", DENSE, {"parallel.tp": 1, "parallel.sequence_parallel": True}, "parallel.sequence_parallel",
     "needs parallel.tp >= 2"),
    ("sp-seq", DENSE, {"parallel.sequence_parallel": True, "model.seq_length": 63},
     "parallel.sequence_parallel", "not divisible by parallel.tp=2"),
    ("ep-no-moe", DENSE, {"parallel.ep": 2}, "parallel.ep", "needs model.moe"),
    ("experts-ep", MOE, {"parallel.ep": 3, "world_size": 3}, "parallel.ep",
     "does not divide model.moe.num_experts=4"),
    ("expert-dp", MOE, {"parallel.ep": 4, "parallel.pp": 2, "model.moe.num_experts": 8}, "parallel.ep",
     "ETP*EP*PP = 1*4*2 = 8 does not divide world_size=4"),
    ("etp-ffn", MOE, {"parallel.etp": 2, "model.moe.ffn_hidden_size": 127}, "parallel.etp",
     "does not divide the expert FFN width 127"),
    ("etp-bias", MOE, {"parallel.tp": 2, "parallel.ep": 2, "parallel.sequence_parallel": True},
     "parallel.etp", "needs ETP=1"),
    ("topk-experts", MOE, {"model.moe.router_topk": 5}, "model.moe.router_topk",
     "exceeds model.moe.num_experts=4"),
    ("topk-one", MOE, {"model.moe.router_topk": 1}, "model.moe.router_topk", "--moe-router-pre-softmax"),
    ("ep-tp-sp", MOE, {"parallel.tp": 2, "parallel.ep": 2, "parallel.etp": 1}, "parallel.sequence_parallel",
     "must be true when parallel.ep > 1 and parallel.tp > 1"),
    ("gbs", DENSE, {"training.global_batch_size": 7}, "training.global_batch_size",
     "not divisible by micro_batch_size*DP = 2*1 = 2"),
    ("opg-distopt", DENSE, {"parallel.overlap_param_gather": True, "parallel.overlap_grad_reduce": True},
     "parallel.overlap_param_gather", "distributed_optimizer"),
    ("opg-ogr", DENSE, {"parallel.overlap_param_gather": True, "parallel.distributed_optimizer": True},
     "parallel.overlap_param_gather", "overlap_grad_reduce"),
]


def test_bad_table_bases_are_valid():
    """The table's bases must pass, or its rows would prove nothing."""
    validate_dict(DENSE)
    validate_dict(MOE)


@pytest.mark.parametrize(("base", "changes", "field", "fragment"), [row[1:] for row in BAD],
                         ids=[row[0] for row in BAD])
def test_bad_recipe_rejected_with_field(base, changes, field, fragment):
    assert_problem(problems_of(mutate(base, changes)), field, fragment)


def test_query_groups_te_accepts_divisor_of_tp():
    """Transformer Engine replicates KV heads when groups < TP; local attention cannot."""
    te = {"model.num_query_groups": 1, "model.transformer_impl": "transformer_engine"}
    recipe = validate_dict(mutate(DENSE, te))
    assert "--num-query-groups" in render_args(recipe)
    local = problems_of(mutate(DENSE, {"model.num_query_groups": 1}))
    assert_problem(local, "parallel.tp", "local attention")


def test_escape_hatches_in_extra_args():
    """Rules that Megatron ties to a flag are lifted when that flag is passed through."""
    validate_dict(mutate(MOE, {"model.moe.router_topk": 1, "extra_args": ["--moe-router-pre-softmax"]}))
    validate_dict(mutate(MOE, {"parallel.etp": 2, "extra_args": ["--disable-bias-linear"]}))


def test_unknown_keys_rejected_with_suggestion():
    data = mutate(DENSE, {"model.num_layer": 4, "wrold_size": 4, "parallel.tensor_parallel": 2})
    err = problems_of(data)
    assert_problem(err, "model.num_layer", "did you mean 'num_layers'")
    assert_problem(err, "wrold_size", "did you mean 'world_size'")
    assert_problem(err, "parallel.tensor_parallel", "unknown key")


@pytest.mark.parametrize("version", [4, 0, "1", None, True])
def test_wrong_version_names_supported(version):
    err = problems_of(mutate(DENSE, {"version": version}))
    assert err.fields() == ["version"]
    assert "supported versions: 1, 2, 3" in str(err)


def test_missing_version():
    assert_problem(problems_of(mutate(DENSE, {"version": DELETE})), "version", "supported versions: 1, 2, 3")


def test_all_violations_reported_together_naming_the_file():
    text = to_yaml(mutate(DENSE, {"parallel.tp": 3, "world_size": 6, "parallel.pp": 1,
                                  "training.precision": "fp8", "model.num_layr": 1}))
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, "recipes/mini/x.yaml")
    err = info.value
    assert {"parallel.tp", "training.precision", "model.num_layr"} <= set(err.fields())
    lines = str(err).splitlines()
    assert len(lines) == len(err.problems) >= 3
    assert all(line.startswith("recipes/mini/x.yaml: ") for line in lines)
    assert "recipes/mini/x.yaml: parallel.tp: 3 does not divide model.num_attention_heads=4" in lines
    assert isinstance(err, ValueError)


def to_yaml(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False)


# --- YAML and files ------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "where", "fragment"), [
    ("version: 1\nmodel: {num_layers: 4\n", "line", "invalid YAML"),
    ("version: 1\nversion: 1\n", "line 2, column 1", "duplicate key 'version'"),
    ("", "(top level)", "empty"),
    ("- 1\n- 2\n", "(top level)", "expected a mapping"),
])
def test_yaml_errors_are_recipe_errors(text, where, fragment):
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, "x.yaml")
    (got_where, msg), = info.value.problems
    assert got_where.startswith(where) and fragment in msg
    assert str(info.value).startswith("x.yaml: ")


def test_load_file_names_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "bad.yaml"
    path.write_text(to_yaml(mutate(DENSE, {"parallel.tp": 3})))
    with pytest.raises(RecipeError) as info:
        load_file(path)
    lines = str(info.value).splitlines()
    assert "bad.yaml: parallel.tp: 3 does not divide model.num_attention_heads=4" in lines
    with pytest.raises(RecipeError, match="no such file"):
        load_recipe(tmp_path / "missing.yaml")


def test_find_by_name_variants():
    path = RECIPES_DIR / "mini" / "dense-tp2pp2.yaml"
    for key in ("mini-dense-tp2pp2", "mini/dense-tp2pp2", "dense-tp2pp2", str(path)):
        assert find_recipe(key).resolve() == path.resolve()
    with pytest.raises(RecipeError, match="shipped recipes: .*mini-moe-ep2"):
        find_recipe("no-such-recipe")


def test_recipe_files_are_all_yaml_in_recipes():
    assert all(p.suffix == ".yaml" and RECIPES_DIR in p.parents for p in recipe_files())


# --- rendering -----------------------------------------------------------------------------------


def test_render_exact_flags_dense_tp2pp2():
    assert render_args(load_recipe("mini-dense-tp2pp2")) == [
        "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "256",
        "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--mock-data",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
        "--lr", "0.0001", "--seed", "1234", "--optimizer", "adam",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--context-parallel-size", "1", "--expert-model-parallel-size", "1",
        "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
        "--log-interval", "1", "--eval-iters", "0",
    ]


def flag_values(args: list[str], flag: str) -> list[str]:
    i = args.index(flag)
    out = []
    for tok in args[i + 1:]:
        if tok.startswith("--"):
            break
        out.append(tok)
    return out


def test_render_options():
    moe = load_recipe("mini-moe-ep4-tp1pp2")
    args = render_args(moe)
    assert flag_values(args, "--num-experts") == ["8"]
    assert flag_values(args, "--expert-model-parallel-size") == ["4"]
    assert flag_values(args, "--expert-tensor-parallel-size") == ["1"]
    assert flag_values(args, "--moe-token-dispatcher-type") == ["alltoall"]
    assert flag_values(args, "--moe-ffn-hidden-size") == ["128"]
    vpp = render_args(load_recipe("mini-dense-pp2vpp2"))
    assert flag_values(vpp, "--num-virtual-stages-per-pipeline-rank") == ["2"]
    distopt = render_args(load_recipe("mini-dense-tp2dp2-distopt"))
    assert "--use-distributed-optimizer" in distopt and "--overlap-grad-reduce" in distopt
    assert "--overlap-param-gather" not in distopt
    assert "--sequence-parallel" in render_args(load_recipe("mini-dense-tp2-sp"))
    cp = render_args(load_recipe("mini-dense-cp2"))
    assert flag_values(cp, "--transformer-impl") == ["transformer_engine"]
    assert "--no-gradient-accumulation-fusion" not in cp
    bf16 = validate_dict(mutate(DENSE, {"training.precision": "bf16", "model.num_query_groups": 2,
                                        "extra_args": ["--log-interval", "5"]}))
    args = render_args(bf16)
    assert "--bf16" in args and "--fp16" not in args
    assert flag_values(args, "--num-query-groups") == ["2"] and "--group-query-attention" in args
    assert args[-2:] == ["--log-interval", "5"]
    assert "--fp16" in render_args(validate_dict(mutate(DENSE, {"training.precision": "fp16"})))
    assert not {"--bf16", "--fp16"} & set(render_args(validate_dict(DENSE)))


def test_render_env():
    assert render_env(load_recipe("mini-dense-tp2pp2")) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert render_env(load_recipe("mini-dense-cp2")) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert render_env(load_recipe("mini-moe-ep2")) == {}


def test_rendered_flags_are_recipe_owned():
    """Every flag render emits is reserved against extra_args, so none can be overridden silently."""
    for name in SHIPPED:
        recipe = load_recipe(name)
        own = render_args(dataclasses.replace(recipe, extra_args=()))
        assert {a for a in own if a.startswith("--")} <= set(RECIPE_FLAGS), name


def test_parameter_estimate_matches_gptmodel():
    # Counted from megatron-core 0.16.1 GPTModel(local spec, tied embeddings) built on CPU:
    # vocab padded 1152 (TP1) / 1280 (TP2); 4 layers, hidden 64, ffn 256, 4 heads, seq 64.
    assert estimate_parameters(load_recipe("mini-dense-pp2vpp2")) == 277_888
    assert estimate_parameters(load_recipe("mini-dense-tp2pp2")) == 277_888 + 128 * 64
    assert estimate_parameters(validate_dict(mutate(MOE, {"parallel.ep": 1}))) == 411_792  # 4 experts
    gqa = validate_dict(mutate(DENSE, {"model.num_query_groups": 2, "parallel.tp": 1, "parallel.pp": 1}))
    assert estimate_parameters(gqa) == 261_248


def test_show_contains_layout_and_pasteable_flags():
    text = show("mini-dense-tp2pp2dp2")
    assert "TP2xPP2xCP1xDP2" in text
    assert re.search(r"world size\s+8 GPUs", text)
    assert re.search(r"experts\s+EP1", text) and re.search(r"VPP\s+none", text)
    assert "parameters" in text and "286,080" in text
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in text
    flags = text.split("flags (megatron-core 0.16.1):\n", 1)[1]
    assert shlex.split(flags.replace("\\\n", " ")) == render_args(load_recipe("mini-dense-tp2pp2dp2"))
    assert all(line.startswith("  --") for line in flags.splitlines())
    vpp = show("mini-dense-pp2vpp2")
    assert re.search(r"VPP\s+2 \(interleaved", vpp)
    assert re.search(r"experts\s+EP4 x ETP1, expert DP1", show("mini-moe-ep4-tp1pp2"))


def test_format_args_quotes_values():
    assert format_args(["--a", "x y", "--b"]) == "  --a 'x y' \\\n  --b"


# --- agreement with megatron-core (always runs) -------------------------------------------------


def _quiet_import(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def core_config(recipe: Recipe):
    """TransformerConfig for the recipe, mapped as Megatron-LM's core_transformer_config_from_args does."""
    torch = _quiet_import("torch")
    TransformerConfig = _quiet_import("megatron.core.transformer").TransformerConfig
    m, p, t = recipe.model, recipe.parallel, recipe.training
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[t.precision]
    extra = set(recipe.extra_args)
    kw = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn,
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp, context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep, expert_tensor_parallel_size=p.etp,
        sequence_parallel=p.sequence_parallel, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=t.precision == "bf16", fp16=t.precision == "fp16",
        add_bias_linear="--disable-bias-linear" not in extra,
    )
    if m.moe is not None:
        kw.update(num_moe_experts=m.moe.num_experts, moe_router_topk=m.moe.router_topk,
                  moe_token_dispatcher_type=m.moe.token_dispatcher, moe_ffn_hidden_size=m.moe_ffn,
                  moe_aux_loss_coeff=m.moe.aux_loss_coeff,
                  moe_router_pre_softmax="--moe-router-pre-softmax" in extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(**kw)


def build_layers(recipe: Recipe) -> list[int]:
    """Layers per (pp rank, virtual stage), from megatron-core's get_num_layers_to_build."""
    block = _quiet_import("megatron.core.transformer.transformer_block")
    config = core_config(recipe)
    stages = recipe.parallel.vpp or 1
    return [block.get_num_layers_to_build(config, vp_stage=v if recipe.parallel.vpp else None, pp_rank=r)
            for r in range(recipe.parallel.pp) for v in range(stages)]


def microbatches(recipe: Recipe) -> int:
    calc = _quiet_import("megatron.core.num_microbatches_calculator")
    t = recipe.training
    return calc.ConstantNumMicroBatchesCalculator(t.global_batch_size, t.micro_batch_size, recipe.dp,
                                                  False, 0).get()


@pytest.fixture
def fake_world():
    """torch's in-process fake backend at the target world size, torn down after the test."""
    dist = _quiet_import("torch.distributed")
    fake_pg = _quiet_import("torch.testing._internal.distributed.fake_pg")
    ps = _quiet_import("megatron.core.parallel_state")
    assert not dist.is_initialized(), "another test left a default process group behind"
    started = []

    def start(recipe: Recipe, rank: int = 0):
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=recipe.world_size)
        started.append(True)
        p = recipe.parallel
        ps.initialize_model_parallel(
            tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
            virtual_pipeline_model_parallel_size=p.vpp, context_parallel_size=p.cp,
            expert_model_parallel_size=p.ep, expert_tensor_parallel_size=p.etp,
            create_gloo_process_groups=False)
        return ps

    yield start
    ps.destroy_model_parallel()
    if started and dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_megatron_core_builds_the_layout(name, fake_world):
    recipe = load_recipe(name)
    ps = fake_world(recipe, rank=recipe.world_size - 1)
    p = recipe.parallel
    assert ps.get_tensor_model_parallel_world_size() == p.tp
    assert ps.get_pipeline_model_parallel_world_size() == p.pp
    assert ps.get_context_parallel_world_size() == p.cp
    assert ps.get_data_parallel_world_size() == recipe.dp
    assert ps.get_expert_model_parallel_world_size() == p.ep
    assert ps.get_expert_tensor_parallel_world_size() == recipe.etp
    assert ps.get_expert_data_parallel_world_size() == recipe.expert_dp
    assert ps.get_virtual_pipeline_model_parallel_world_size() == p.vpp
    config = core_config(recipe)
    assert config.expert_tensor_parallel_size == recipe.etp
    layers = build_layers(recipe)
    assert sum(layers) == recipe.model.num_layers and len(set(layers)) == 1
    assert microbatches(recipe) == recipe.num_microbatches


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_megatron_core_builds_the_target_layout(name, fake_world):
    """parallel_state at the target's full world size (8,192 ranks for the largest) agrees with the
    recipe's derived sizes; the microbatch calculator with its microbatches per DP rank."""
    recipe = load_recipe(name)
    ps = fake_world(recipe, rank=recipe.world_size - 1)
    p = recipe.parallel
    got = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
           ps.get_context_parallel_world_size(), ps.get_data_parallel_world_size(),
           ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size(),
           ps.get_expert_data_parallel_world_size())
    assert got == (p.tp, p.pp, p.cp, recipe.dp, p.ep, recipe.etp, recipe.expert_dp)
    assert microbatches(recipe) == recipe.num_microbatches


# Rules whose Megatron counterpart runs without Megatron-LM: (id, base, changes, our field, stage).
CORE_AGREEMENT = [
    # id, base, changes, our field, Megatron stage, what Megatron says
    ("heads-tp", DENSE, {"parallel.tp": 4, "parallel.pp": 1, "model.num_attention_heads": 2}, "parallel.tp",
     "config", "must be a multiple of tensor_model_parallel_size"),
    ("topk-one", MOE, {"model.moe.router_topk": 1}, "model.moe.router_topk", "config",
     "moe-router-pre-softmax"),
    ("etp-bias", MOE, {"parallel.etp": 2}, "parallel.etp", "config", "only supported when ETP==1"),
    ("ep-no-moe", DENSE, {"parallel.ep": 2, "parallel.pp": 1}, "parallel.ep", "config",
     "num_moe_experts must be non None"),
    ("sp-tp1", DENSE, {"parallel.tp": 1, "parallel.sequence_parallel": True}, "parallel.sequence_parallel",
     "config", "sequence parallelism without tensor parallelism"),
    ("layers-pp", DENSE, {"model.num_layers": 3}, "parallel.pp", "layers",
     r"divisible by (config\.)?pipeline_model_parallel_size"),  # 0.19 names it config.pipeline_...
    ("vpp-layers", DENSE, {"parallel.vpp": 4}, "parallel.vpp", "layers", "divisible by vp_size"),
    ("expert-dp", MOE, {"parallel.ep": 4, "parallel.pp": 2, "model.moe.num_experts": 8}, "parallel.ep", "pg",
     "expert_tensor_model_pipeline_parallel size"),
    ("world-divisible", DENSE, {"world_size": 6}, "world_size", "pg", r"world_size \(6\) is not divisible"),
    ("gbs", DENSE, {"training.global_batch_size": 7}, "training.global_batch_size", "microbatches",
     "not divisible by micro batch size"),
]


def _unvalidated(data: dict) -> Recipe:
    """Dataclasses straight from data, bypassing the rules, so Megatron can judge them."""
    reader = schema._Reader()
    recipe = reader.section(Recipe, data, "")
    assert not reader.problems, reader.problems  # only the rules are bypassed, not the types
    return recipe


@pytest.mark.parametrize(("base", "changes", "field", "stage", "says"), [row[1:] for row in CORE_AGREEMENT],
                         ids=[row[0] for row in CORE_AGREEMENT])
def test_megatron_core_rejects_what_we_reject(base, changes, field, stage, says, fake_world):
    data = mutate(base, changes)
    assert field in problems_of(data).fields()
    recipe = _unvalidated(data)
    with pytest.raises((AssertionError, ValueError, RuntimeError), match=says):
        if stage == "config":
            core_config(recipe)
        elif stage == "layers":
            build_layers(recipe)
        elif stage == "pg":
            fake_world(recipe)
        else:
            microbatches(recipe)


# --- Megatron-LM's own parser and validate_args (needs a Megatron-LM checkout) -------------------


def _megatron_lm_training_dir() -> Path | None:
    candidates = []
    if os.environ.get("MEGATRON_LM_PATH"):
        candidates.append(Path(os.environ["MEGATRON_LM_PATH"]) / "megatron" / "training")
    candidates.append(REPO / "third_party" / "Megatron-LM" / "megatron" / "training")
    spec = importlib.util.find_spec("megatron.training")
    if spec is not None and spec.submodule_search_locations:
        candidates.extend(Path(p) for p in spec.submodule_search_locations)
    return next((c for c in candidates if (c / "arguments.py").is_file()), None)


def _utils_shim() -> types.ModuleType:
    """The five helpers arguments.py imports from megatron/training/utils.py, restated.

    Importing the real utils.py pulls in the whole training stack (tokenizers need six and regex,
    initialize.py needs triton), none of which the parser uses. get_device_arch_version answers 9
    (Hopper: the H200 targets); it only decides whether CUDA_DEVICE_MAX_CONNECTIONS is enforced.
    """
    shim = types.ModuleType("megatron.training.utils")
    shim.print_rank_0 = lambda message, rank=None: None
    shim.warn_rank_0 = lambda message, rank=None: None
    shim.is_rank0 = lambda: False
    shim.get_device_arch_version = lambda: 9

    def update_use_dist_ckpt(args):
        args.use_dist_ckpt = args.ckpt_format != "torch"

    shim.update_use_dist_ckpt = update_use_dist_ckpt
    return shim


@pytest.fixture(scope="module")
def megatron_lm():
    """Megatron-LM's megatron.training.arguments (real code) over the installed megatron-core."""
    tdir = _megatron_lm_training_dir()
    if tdir is None:
        msg = ("Megatron-LM's megatron/training (tag core_v0.16.1) not found: set MEGATRON_LM_PATH to a "
               "checkout, or put it at third_party/Megatron-LM")
        if os.environ.get("PRISM_REQUIRE_MEGATRON_LM"):
            pytest.fail(msg)
        pytest.skip(msg)
    info = tdir.parent / "core" / "package_info.py"
    if info.is_file():
        text = info.read_text()
        # one release line, not one patch: the pinned tag core_v0.19.0's package_info says 0.19.1, its wheel 0.19.2
        parts = (re.search(rf"^{k} = (\d+)", text, re.M).group(1) for k in ("MAJOR", "MINOR"))
        checkout, installed = ".".join(parts), importlib.metadata.version("megatron-core")
        assert installed.startswith(checkout + "."), f"Megatron-LM at {tdir} is {checkout}.x, megatron-core is " \
            f"{installed}"
    prefix = "megatron.training"
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == prefix or k.startswith(prefix + ".")}
    package = types.ModuleType(prefix)
    package.__path__ = [str(tdir)]  # skip megatron/training/__init__.py (it imports the trainer)
    sys.modules[prefix] = package
    sys.modules[prefix + ".utils"] = _utils_shim()
    try:
        yield _quiet_import(prefix + ".arguments")
    finally:
        for k in [k for k in sys.modules if k == prefix or k.startswith(prefix + ".")]:
            del sys.modules[k]
        sys.modules.update(saved)


def megatron_parse(arguments, recipe: Recipe, monkeypatch):
    """Parse the rendered flags as pretrain_gpt.py would, then run validate_args and build the config."""
    argv = ["pretrain_gpt.py", *render_args(recipe)]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setenv("WORLD_SIZE", str(recipe.world_size))
    monkeypatch.setenv("RANK", "0")
    for key, value in render_env(recipe).items():
        monkeypatch.setenv(key, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            args = arguments.parse_args(ignore_unknown_args=False)
        except SystemExit as exc:
            msg = f"Megatron-LM's parser rejected {shlex.join(argv)} (exit {exc.code})"
            raise AssertionError(msg) from None
        args = arguments.validate_args(args)
        config = arguments.core_transformer_config_from_args(args)
    return args, config


@pytest.mark.parametrize("name", sorted(SHIPPED) + sorted(TARGETS) + ["bf16-gqa", "fp16"])
def test_megatron_lm_parses_rendered_flags(name, megatron_lm, monkeypatch):
    if name == "bf16-gqa":
        recipe = validate_dict(mutate(DENSE, {"training.precision": "bf16", "model.num_query_groups": 2}))
    elif name == "fp16":
        recipe = validate_dict(mutate(MOE, {"training.precision": "fp16",
                                            "parallel.distributed_optimizer": True,
                                            "parallel.overlap_grad_reduce": True,
                                            "parallel.overlap_param_gather": True}))
    else:
        recipe = load_recipe(name)
    args, config = megatron_parse(megatron_lm, recipe, monkeypatch)
    m, p, t = recipe.model, recipe.parallel, recipe.training
    expected = {
        "tensor_model_parallel_size": p.tp, "pipeline_model_parallel_size": p.pp,
        "context_parallel_size": p.cp, "expert_model_parallel_size": p.ep,
        "expert_tensor_parallel_size": recipe.etp, "data_parallel_size": recipe.dp,
        "virtual_pipeline_model_parallel_size": p.vpp, "sequence_parallel": p.sequence_parallel,
        "use_distributed_optimizer": p.distributed_optimizer, "overlap_grad_reduce": p.overlap_grad_reduce,
        "overlap_param_gather": p.overlap_param_gather, "num_layers": m.num_layers,
        "hidden_size": m.hidden_size, "ffn_hidden_size": m.ffn, "num_attention_heads": m.num_attention_heads,
        "group_query_attention": m.num_query_groups is not None, "seq_length": m.seq_length,
        "max_position_embeddings": m.max_positions, "vocab_size": m.vocab_size,
        "tokenizer_type": "NullTokenizer", "mock_data": True, "micro_batch_size": t.micro_batch_size,
        "global_batch_size": t.global_batch_size, "train_iters": t.train_iters, "lr": t.lr, "seed": t.seed,
        "optimizer": t.optimizer, "bf16": t.precision == "bf16", "fp16": t.precision == "fp16",
        "transformer_impl": m.transformer_impl,
        "gradient_accumulation_fusion": m.transformer_impl != "local",
        "num_experts": m.moe.num_experts if m.moe else None,
    }
    if m.num_query_groups is not None:
        expected["num_query_groups"] = m.num_query_groups
    if m.moe is not None:
        expected.update(moe_router_topk=m.moe.router_topk, moe_token_dispatcher_type=m.moe.token_dispatcher,
                        moe_ffn_hidden_size=m.moe_ffn, moe_aux_loss_coeff=m.moe.aux_loss_coeff)
    got = {key: getattr(args, key) for key in expected}
    assert got == expected
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
            config.virtual_pipeline_model_parallel_size, config.context_parallel_size,
            config.expert_model_parallel_size, config.expert_tensor_parallel_size,
            config.num_moe_experts) == (p.tp, p.pp, p.vpp, p.cp, p.ep, recipe.etp, expected["num_experts"])


def test_megatron_lm_knows_every_reserved_flag(megatron_lm):
    """RECIPE_FLAGS (what render emits and extra_args may not repeat) are all real 0.16.1 flags."""
    import argparse

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parser = megatron_lm.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    known = {opt for action in parser._actions for opt in action.option_strings}
    assert set(RECIPE_FLAGS) <= known, sorted(set(RECIPE_FLAGS) - known)
    assert "--virtual-pipeline-model-parallel-size" not in known  # why render uses the other VPP flag


# Rules that Megatron-LM's validate_args enforces: our rejection must match a Megatron failure.
ARGS_AGREEMENT = [
    # id, base, changes, our field, what Megatron says ("^$": validate_args' bare assert)
    ("world-divisible", DENSE, {"world_size": 6}, "world_size", r"world size \(6\) is not divisible"),
    ("layers-pp", DENSE, {"model.num_layers": 3}, "parallel.pp", "Number of layers should be divisible"),
    ("hidden-heads", DENSE, {"model.num_attention_heads": 3, "parallel.tp": 1, "parallel.pp": 1},
     "model.num_attention_heads", "^$"),
    ("max-positions", DENSE, {"model.max_position_embeddings": 32}, "model.max_position_embeddings",
     "must be greater than or equal to seq_length"),
    ("cp-seq", DENSE, {"parallel.cp": 2, "parallel.pp": 1, "model.seq_length": 62,
                       "model.transformer_impl": "transformer_engine"}, "parallel.cp",
     "multiple of 2 \\* context-parallel-size"),
    ("experts-ep", MOE, {"parallel.ep": 3, "world_size": 3, "training.global_batch_size": 12}, "parallel.ep",
     "Number of experts should be a multiple"),  # batch divisible by DP 3: 0.19 checks the eval batch first
    ("ep-no-moe", DENSE, {"parallel.ep": 2, "parallel.pp": 1}, "parallel.ep", "num_experts must be non None"),
    ("opg-distopt", DENSE, {"parallel.overlap_param_gather": True, "parallel.overlap_grad_reduce": True},
     "parallel.overlap_param_gather", "only supported with distributed optimizer"),
    ("opg-ogr", DENSE, {"parallel.overlap_param_gather": True, "parallel.distributed_optimizer": True},
     "parallel.overlap_param_gather", "with --overlap-grad-reduce"),
    ("heads-tp", DENSE, {"parallel.tp": 4, "parallel.pp": 1, "model.num_attention_heads": 2}, "parallel.tp",
     "must be a multiple of tensor_model_parallel_size"),
    ("topk-one", MOE, {"model.moe.router_topk": 1}, "model.moe.router_topk", "moe-router-pre-softmax"),
    ("etp-bias", MOE, {"parallel.etp": 2}, "parallel.etp", "only supported when ETP==1"),
]


@pytest.mark.parametrize(("base", "changes", "field", "says"), [row[1:] for row in ARGS_AGREEMENT],
                         ids=[row[0] for row in ARGS_AGREEMENT])
def test_megatron_lm_rejects_what_we_reject(base, changes, field, says, megatron_lm, monkeypatch):
    data = mutate(base, changes)
    assert field in problems_of(data).fields()
    with pytest.raises((AssertionError, ValueError, RuntimeError), match=says):
        megatron_parse(megatron_lm, _unvalidated(data), monkeypatch)
