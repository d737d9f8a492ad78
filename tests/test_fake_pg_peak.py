"""bench/targets/fake_pg_peak.py: Megatron's --fake-process-group peak of a target recipe's ranks.

The Megatron command line must be prism's own for the recipe (plus the fake process group and capped
iterations); a rank that runs out of device memory must be reported as OOM, not as a crash; and a shrunk
target runs end to end here on CPU with Megatron's fake process group and prism's rendering seams.
"""

from __future__ import annotations

import pytest

from prism_megatron.megatron.megatron_lm import training_available
from tests.bench_scripts import load_bench

pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(not training_available(), reason="no Megatron-LM checkout (set MEGATRON_LM_PATH)")]

SHRINK = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "8",
          "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "1000"]


def _tool():
    return load_bench('targets/fake_pg_peak.py')


def _last(args: list[str], flag: str) -> str:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag][-1]


def test_argv_is_prisms_own_plus_fake_process_group():
    from prism_megatron.megatron.microbatch_mode import choose_microbatches
    from prism_megatron.megatron.run import parse_run_args

    tool = _tool()
    request = parse_run_args([*tool.plan_flags("llama3-8b-h100x8", "replica"), *SHRINK])
    folded, _ = choose_microbatches("auto", request.script, list(request.script_args), 8, 8, env=request.env,
                                    say=lambda m: None)
    args, env, world = tool.megatron_argv("llama3-8b-h100x8", depth="replica", overrides=SHRINK)
    assert world == 8 and env["PRISM_ATTENTION"] == "sdpa"
    assert args[:len(folded)] == folded  # prism's ranks' command line, untouched, first
    assert args[-1] == "--fake-process-group" and _last(args, "--train-iters") == "3"
    assert _last(args, "--eval-interval") == "1000" and _last(args, "--tokenizer-type") == "NullTokenizer"
    assert not any(a.startswith("--prism-") for a in args)  # Megatron-LM's own parser sees no prism flag
    recipe, _, _ = tool.megatron_argv("llama3-8b-h100x8", depth="replica", microbatches="recipe", iters=1,
                                      overrides=SHRINK)
    assert _last(recipe, "--global-batch-size") == "256" and _last(args, "--global-batch-size") != "256"
    assert _last(recipe, "--train-iters") == "1"
    with pytest.raises(ValueError, match="--iters 0"):
        tool.megatron_argv("llama3-8b-h100x8", depth="replica", iters=0, overrides=SHRINK)


def test_oom_is_reported_as_a_verdict(tmp_path):
    from prism_megatron.megatron.fake_pg_child import OOM_EXIT

    tool = _tool()
    script = tmp_path / "oom.py"
    script.write_text("import torch\nraise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n")
    entry = tool.run_rank(script, [], {}, 8, 3, timeout=120)
    assert entry["oom"] is True and entry["exit"] == OOM_EXIT
    assert entry["status"].startswith("OOM") and "Tried to allocate 2.00 GiB" in entry["error"]
    plain = tmp_path / "plain_oom.py"  # a C++ path raises CUDA's OOM as a plain RuntimeError
    plain.write_text("raise RuntimeError('CUDA out of memory. Tried to allocate 64.00 MiB')\n")
    entry = tool.run_rank(plain, [], {}, 8, 3, timeout=120)
    assert entry["oom"] is True and entry["status"].startswith("OOM") and "64.00 MiB" in entry["error"]
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('bad flag --foo')\n")
    entry = tool.run_rank(broken, [], {}, 8, 3, timeout=120)
    assert entry["status"] == "failed (exit 1)" and "bad flag --foo" in entry["error"] and not entry["oom"]


def test_shrunk_target_middle_stage_trains_under_megatrons_fake_process_group(tmp_path):
    # Llama-3-70B's TP4 PP4 VPP5 layout with sequence parallelism, shrunk; rank 16 is a middle stage's
    # first rank (DP rank 0), which builds no dataset: it trains only as rank 0's broadcast tells it to
    from prism_megatron.megatron.driver import DRIVER_SCRIPT

    tool = _tool()
    # its 80 layers kept (PP4 x VPP5 divide them); query groups TP4 divides; 4 micro-batches per pipeline (DP4)
    shrink = [*SHRINK[2:], "--num-query-groups", "4", "--global-batch-size", "16"]
    args, env, world = tool.megatron_argv("llama3-70b-h100x64", depth="class", microbatches="recipe", iters=1,
                                          overrides=shrink)
    entry = tool.run_rank(DRIVER_SCRIPT, args, env, world, 16, timeout=240, log=tmp_path / "rank16.log")
    assert entry["status"] == "ran" and entry["iterations"] == entry["train_iters"] == 1, entry.get("error")
    assert entry["device"] == "cpu" and entry["max_allocated"] is None  # no allocator figures on CPU
    assert entry["megatron_report"] == {"iteration": 1, "max_allocated": 0, "max_reserved": 0}  # its own line
