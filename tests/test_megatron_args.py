"""Megatron's parser in one serving child (``megatron_args``): planning a run parses its command and the
micro-batch fold's rewrite of it, and each parse must be what a fresh interpreter gives."""

from __future__ import annotations

import pytest

from prism_megatron.megatron import megatron_args
from prism_megatron.megatron.driver import CORE_DRIVER_SCRIPT, DRIVER_SCRIPT
from prism_megatron.megatron.megatron_args import ArgsError, close_parser
from prism_megatron.megatron.megatron_args import parse_megatron_args as parse  # not conftest's once-per-command
from prism_megatron.megatron.megatron_lm import training_available

pytestmark = pytest.mark.megatron

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
        "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "64", "--train-iters", "2",
        "--lr", "1e-4", "--pipeline-model-parallel-size", "2", "--transformer-impl", "local"]
_NO_TRAINING = pytest.mark.skipif(not training_available(), reason="megatron.training is not importable (set "
                                  "MEGATRON_LM_PATH to a Megatron-LM checkout)")
SCRIPTS = [pytest.param(CORE_DRIVER_SCRIPT, id="core"), pytest.param(DRIVER_SCRIPT, id="training", marks=_NO_TRAINING)]


def _child_pid() -> int:
    assert megatron_args._PARSER is not None and megatron_args._PARSER.alive()
    return megatron_args._PARSER.proc.pid


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_command_parsed_after_another_in_the_same_child_is_what_a_fresh_child_gives(script):
    close_parser()
    try:
        first = parse(script, BASE, 8)
        pid = _child_pid()
        rewritten = BASE + ["--global-batch-size", "16"]  # the micro-batch fold's rewrite
        second = parse(script, rewritten, 8)
        assert _child_pid() == pid, "the second command line started a child of its own"
        close_parser()
        fresh = parse(script, rewritten, 8)
        assert _child_pid() != pid
    finally:
        close_parser()
    assert (first.global_batch_size, second.global_batch_size) == (64, 16)
    assert vars(second) == vars(fresh)
    assert second.prism_megatron_estimate == fresh.prism_megatron_estimate


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_refused_command_leaves_the_child_serving(script):
    close_parser()
    try:
        with pytest.raises(ArgsError, match=r"(unrecognized arguments|unknown flag\(s\)):? --no-such-flag"):
            parse(script, BASE + ["--no-such-flag"], 8)
        pid = _child_pid()
        assert parse(script, BASE, 8).pipeline_model_parallel_size == 2
        assert _child_pid() == pid
    finally:
        close_parser()


def test_a_child_that_died_is_replaced():
    close_parser()
    try:
        parse(CORE_DRIVER_SCRIPT, BASE, 8)
        megatron_args._PARSER.proc.kill()
        megatron_args._PARSER.proc.wait()
        assert parse(CORE_DRIVER_SCRIPT, BASE + ["--train-iters", "3"], 8).train_iters == 3
    finally:
        close_parser()


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_parse_sees_its_own_world_size_and_environment(script, monkeypatch):
    """The world size and the environment are the request's, not those the child started with: another world
    size, and a variable the caller's libraries set between two parses (torch sets TORCHINDUCTOR_CACHE_DIR), keep
    the child; what decides its imports (``IMPORT_VARS``) replaces it."""
    close_parser()
    try:
        parse(script, BASE, 8)
        pid = _child_pid()
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "elsewhere")
        served = parse(script, BASE, 16, {"PRISM_TEST_VARIABLE": "1"})
        assert _child_pid() == pid
        close_parser()
        fresh = parse(script, BASE, 16, {"PRISM_TEST_VARIABLE": "1"})
        assert vars(served) == vars(fresh)
        if script == DRIVER_SCRIPT:  # Megatron-LM's validate_args reads WORLD_SIZE (the core driver's parser does not)
            assert (served.world_size, served.data_parallel_size) == (16, 8)
        pid = _child_pid()
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        parse(script, BASE, 8)
        assert _child_pid() != pid
    finally:
        close_parser()


def test_commands_asked_ahead_are_answered_each_its_own_in_any_order():
    """A run asks for its command's parse at its start (``ask_megatron_args``) and reads it after its own imports;
    the child answers in the order asked, and each read gets its own command's args, a repeated ask no second
    parse, whichever is read first."""
    close_parser()
    try:
        megatron_args.ask_megatron_args(CORE_DRIVER_SCRIPT, BASE, 8)
        rewritten = BASE + ["--global-batch-size", "16"]
        megatron_args.ask_megatron_args(CORE_DRIVER_SCRIPT, rewritten, 8)
        megatron_args.ask_megatron_args(CORE_DRIVER_SCRIPT, BASE, 8)
        pid = _child_pid()
        assert len(megatron_args._PARSER.asked) == 2
        second = parse(CORE_DRIVER_SCRIPT, rewritten, 8)  # read first, though asked second
        first = parse(CORE_DRIVER_SCRIPT, BASE, 8)
        assert _child_pid() == pid and megatron_args._PARSER.asked == []
        close_parser()
        fresh = parse(CORE_DRIVER_SCRIPT, BASE, 8)
    finally:
        close_parser()
    assert (first.global_batch_size, second.global_batch_size) == (64, 16)
    assert vars(first) == vars(fresh)
