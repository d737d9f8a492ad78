"""--prism-experts grouped: Megatron's SequentialMLP computed with torch grouped_mm over its own weights.

Forward values, input and weight gradients equal the loop over experts (fp32 to rounding, bf16 within
bf16 rounding), with an expert that receives no token; the weight gradients land in each expert's own
``.grad`` (plain module) or ``.main_grad`` (Megatron's DDP with the distributed optimizer, whose buffer
holds the experts in reverse order); the experts' weights are one allocation per linear, viewed (never
copied) by the grouped GEMM; activations kept for the backward are Megatron's; a DDP layout that no
uniform stride can view is refused by name. The cases run in a child process (Megatron's parallel
state, one gloo rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.megatron

CHILD = textwrap.dedent("""
    import json, socket, sys
    import torch
    import torch.nn.functional as F
    from prism_megatron.megatron.cpu_mode import enable_cpu_mode
    enable_cpu_mode()  # as a CPU rank runs: jit_fuser functions uncompiled
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from prism_megatron.memory.accountant import ByteAccountant
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    H, FFN, COUNTS = 64, 40, [5, 0, 9, 2]  # expert 1 gets no token
    E, T = len(COUNTS), sum(COUNTS)

    def config(dtype, fused, h=H, ffn=FFN):
        return TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=4, num_moe_experts=E,
                                 moe_ffn_hidden_size=ffn, ffn_hidden_size=4 * h, gated_linear_unit=True,
                                 init_method_std=0.5,
                                 activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=fused,
                                 use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16)

    def build(dtype, fused, ddp=None, state=None, h=H, ffn=FFN):
        cfg = config(dtype, fused, h, ffn)
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        m = SequentialMLP(E, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                          pg_collection=pgs)
        if state is not None:
            m.load_state_dict(state)
        if ddp is not None:
            m = DistributedDataParallel(cfg, DistributedDataParallelConfig(**ddp), m)
        return m

    def inputs(dtype, t):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(t, H, generator=g).to(dtype).requires_grad_()
        probs = torch.rand(t, generator=g).to(dtype)
        dy = torch.randn(t, H, generator=g).to(dtype)
        return x, probs, dy

    def run(m, dtype, counts=COUNTS):
        inner = getattr(m, "module", m)
        x, probs, dy = inputs(dtype, sum(counts))
        kept = {}
        def pack(t):
            if not isinstance(t, torch.nn.Parameter):
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        acct = ByteAccountant()
        with acct, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, bias = m(x, torch.tensor(counts), probs)
            out.backward(dy)
        grads = {}
        for e, expert in enumerate(inner.local_experts):
            for name in ("linear_fc1", "linear_fc2"):
                w = getattr(expert, name).weight
                g = w.main_grad if hasattr(w, "main_grad") else w.grad
                grads[f"{e}.{name}"] = g.detach().float().clone()
        return dict(out=out.detach().float(), bias=bias, dx=x.grad.float(), grads=grads, kept=sum(kept.values()),
                    peak=acct.peak)

    def amax(t):
        return t.abs().max().item() if t.numel() else 0.0

    def compare(a, b):
        return dict(out=amax(a["out"] - b["out"]), dx=amax(a["dx"] - b["dx"]), shape=list(b["out"].shape),
                    dw=max(amax(a["grads"][k] - b["grads"][k]) for k in a["grads"]), scale=amax(a["out"]),
                    grad_norm=max(amax(g) for g in b["grads"].values()), bias=b["bias"], kept=[a["kept"], b["kept"]],
                    peak=[a["peak"], b["peak"]], empty_grad=b["grads"]["1.linear_fc1"].abs().max().item())

    def layout(m):
        inner = getattr(m, "module", m)
        res = {}
        for name in ("linear_fc1", "linear_fc2"):
            ws = [getattr(x, name).weight for x in inner.local_experts]
            res[name] = dict(storages=len({w.untyped_storage().data_ptr() for w in ws}),
                             offsets=[w.storage_offset() for w in ws], numel=ws[0].numel(),
                             storage_numel=ws[0].untyped_storage().nbytes() // ws[0].element_size())
        return res

    def ranges(m):
        # each parameter's (start, end, bucket) in DDP's buffers, by name, and each buffer's bucket bounds
        names = {p: n for n, p in m.module.named_parameters()}
        bufs = list(m.buffers) + list(m.expert_parallel_buffers)
        return dict(params={names[p]: list(r) for b in bufs for p, r in b.param_index_map.items()},
                    buckets=[[list(x) for x in b.bucket_indices] for b in bufs])

    DISTOPT = dict(use_distributed_optimizer=True, overlap_grad_reduce=False, bucket_size=None)
    cases = {"fp32": (torch.float32, True), "fp32-unfused": (torch.float32, False), "bf16": (torch.bfloat16, True)}
    torch.manual_seed(0)
    built = {k: build(dt, fused) for k, (dt, fused) in cases.items()}
    states = {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in m.state_dict().items()}
              for k, m in built.items()}
    refs = {k: run(built[k], dt) for k, (dt, _) in cases.items()}
    ref_ddp_model = build(torch.float32, True, DISTOPT, states["fp32"])
    ref_ddp = run(ref_ddp_model, torch.float32)
    ref_ranges, ref_layout = ranges(ref_ddp_model), layout(ref_ddp_model)
    # two buckets that part a linear's experts at a boundary needing no padding (3 experts' fc1 + fc2 in the first)
    BUCKETED = dict(DISTOPT, overlap_grad_reduce=True, bucket_size=3 * 3 * FFN * H)
    ref_bucketed_model = build(torch.float32, True, BUCKETED, states["fp32"])
    ref_bucketed = run(ref_bucketed_model, torch.float32)
    ref_bucketed_ranges = ranges(ref_bucketed_model)
    ref_none = run(build(torch.float32, True, DISTOPT, states["fp32"]), torch.float32, [0] * E)

    OVERLAP = dict(DISTOPT, overlap_grad_reduce=True, overlap_param_gather=True)

    def overlap_run(m, iters=3):
        # Megatron's order under --overlap-param-gather: each iteration after the first dispatches every
        # bucket group's all-gather first (the interleaved schedule's param_sync_func), the forward's module
        # pre-hooks wait on them. Counts the all-gathers still pending after each forward.
        groups = m.bucket_groups + m.expert_parallel_bucket_groups
        pending, error = [], None
        try:
            for it in range(iters):
                m.zero_grad_buffer()
                if it:
                    m.start_param_sync()
                x, probs, dy = inputs(torch.float32, T)
                out, _ = m(x, torch.tensor(COUNTS), probs)
                pending.append(sum(g.param_gather_handle is not None for g in groups))
                out.backward(dy)
                m.finish_grad_sync()
        except AssertionError as e:
            import traceback
            error = traceback.format_exc(limit=-1)
        return dict(pending=pending, error=error, groups=len(groups))

    ref_overlap = overlap_run(build(torch.float32, True, OVERLAP, states["fp32"]))

    from prism_megatron.patches import grouped_experts
    grouped_experts.install()
    results = {}
    for k, (dt, fused) in cases.items():
        m = build(dt, fused, state=states[k])
        results[k] = compare(refs[k], run(m, dt)) | {"layout": layout(m)}
    m = build(torch.float32, True, DISTOPT, states["fp32"])
    results["distopt"] = compare(ref_ddp, run(m, torch.float32)) | dict(
        layout=layout(m), ranges=ranges(m), ref_ranges=ref_ranges, ref_layout=ref_layout)
    m = build(torch.float32, True, BUCKETED, states["fp32"])
    results["bucketed"] = compare(ref_bucketed, run(m, torch.float32)) | {"layout": layout(m), "ranges": ranges(m),
                                                                          "ref_ranges": ref_bucketed_ranges}
    m = build(torch.float32, True, DISTOPT, states["fp32"])
    results["no-tokens"] = compare(ref_none, run(m, torch.float32, [0] * E))
    results["overlap"] = dict(loop=ref_overlap,
                              grouped=overlap_run(build(torch.float32, True, OVERLAP, states["fp32"])))
    m = build(torch.float32, True, state=states["fp32"])
    m.local_experts[1].linear_fc2.register_forward_hook(lambda *a: None)
    try:
        run(m, torch.float32)
        results["post-hook"] = {}
    except grouped_experts.UnsupportedExperts as e:
        results["post-hook"] = {"refused": str(e)}
    # weights of 64k values, not 128k, and a bucket of 3 experts: the bucket's end is padded by 64 values
    h, ffn = 48, 36  # inside the expert stack (DDP pads bucket ends to lcm(DP, 128) under the distributed optimizer)
    m = build(torch.float32, True, dict(DISTOPT, overlap_grad_reduce=True, bucket_size=3 * 3 * ffn * h), h=h, ffn=ffn)
    try:
        inner = m.module
        x = torch.randn(T, h, requires_grad=True)
        m(x, torch.tensor(COUNTS), torch.rand(T))[0].sum().backward()
        results["padded"] = {"layout": layout(m)}
    except grouped_experts.UnsupportedExperts as e:
        results["padded"] = {"refused": str(e), "layout": layout(m)}
    print(json.dumps(results))
""")


def _child(python: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([python, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results() -> dict:
    return _child(sys.executable)


@pytest.mark.parametrize("case, tol", [("fp32", 1e-5), ("fp32-unfused", 1e-5), ("bf16", 2e-2)])
def test_grouped_experts_give_the_loops_values_and_gradients(case, tol, results):
    r = results[case]
    assert r["bias"] is None
    assert r["scale"] > 1.0  # values of order one: the tolerance is relative to them
    rel = tol * r["scale"]
    assert r["out"] <= rel and r["dx"] <= rel and r["dw"] <= rel, r
    assert r["empty_grad"] == 0.0  # the expert without tokens: a zero weight gradient, as the loop gives


def test_each_linears_expert_weights_are_one_allocation_viewed_in_place(results):
    """No copy of the weights: each linear's E weights share one storage of exactly E weights."""
    for case in ("fp32", "bf16"):
        for name, lay in results[case]["layout"].items():
            assert lay["storages"] == 1 and lay["storage_numel"] == 4 * lay["numel"], (case, name, lay)
            assert lay["offsets"] == [e * lay["numel"] for e in range(4)], (case, name, lay)


def test_activation_memory_is_the_loops(results):
    """What autograd keeps for the backward (parameters aside) is the loop's plus the int32 group ends, and
    so is the peak of live bytes where every weight's .grad stays (a plain module)."""
    for case in ("fp32", "bf16"):
        r = results[case]
        ref_kept, kept = r["kept"]
        assert 0 <= kept - ref_kept <= 2 * 4 * 4, r  # two offs tensors of 4 int32
        ref_peak, peak = r["peak"]
        assert abs(peak - ref_peak) <= 2 * 4 * 4 + 4096, r  # plain module: each weight's .grad stays anyway


def test_grads_land_in_main_grad_with_the_experts_ascending_in_the_distributed_optimizers_buffer(results):
    """DDP lays its buffer out backwards, which left the experts in descending order and the grouped GEMM
    regrouping the tokens (copies Transformer Engine never makes); the seam hands the layout each linear's
    experts reversed in their own slots: ascending, every range and bucket bound as Megatron's without it,
    only the experts of one linear trading slots."""
    r = results["distopt"]
    for name in ("linear_fc1", "linear_fc2"):
        offsets = r["layout"][name]["offsets"]
        assert offsets == sorted(offsets) and len(set(offsets)) == 4, (name, offsets)
    ref, got = r["ref_ranges"], r["ranges"]
    assert got["buckets"] == ref["buckets"]
    assert sorted(got["params"].values()) == sorted(ref["params"].values())
    for e in range(4):  # expert e holds the slot Megatron gave expert 3 - e
        for name in ("linear_fc1", "linear_fc2"):
            mine, megatrons = f"local_experts.{e}.{name}.weight", f"local_experts.{3 - e}.{name}.weight"
            assert got["params"][mine] == ref["params"][megatrons], (mine, got["params"], ref["params"])
    before = r["ref_layout"]["linear_fc1"]["offsets"]
    assert before == sorted(before, reverse=True)  # Megatron's own layout: descending
    rel = 1e-5 * r["scale"]
    assert r["out"] <= rel and r["dx"] <= rel and r["dw"] <= rel, r
    assert r["empty_grad"] == 0.0
    # DDP frees each .grad into main_grad: the E weight grads of fc1 are alive at once for a moment (the loop
    # has one); no token is regrouped (T x H each way, which the reversed order cost), and the loop's
    # concatenation of its outputs is a copy the grouped GEMM does not make
    fc1, tokens = 2 * 40 * 64 * 4, 16 * 64 * 4
    ref_peak, peak = r["peak"]
    assert -tokens - 4096 <= peak - ref_peak <= 3 * fc1 + 16 * 4 + 4096, (peak - ref_peak, r)


def test_experts_of_one_linear_in_two_buckets_trade_slots_across_them(results):
    """A bucket boundary between two experts of a linear that needs no padding (a uniform stride still views
    them): the experts trade slots across it, the buffer's buckets are Megatron's, values and gradients the loop's."""
    r = results["bucketed"]
    ref, got = r["ref_ranges"], r["ranges"]
    assert len(got["buckets"][0]) == 2 and got["buckets"] == ref["buckets"], got["buckets"]
    buckets = {name: rng[2] for name, rng in got["params"].items()}
    assert buckets["local_experts.3.linear_fc1.weight"] != buckets["local_experts.0.linear_fc1.weight"]
    assert r["layout"]["linear_fc1"]["offsets"] == sorted(r["layout"]["linear_fc1"]["offsets"])
    rel = 1e-5 * r["scale"]
    assert r["out"] <= rel and r["dx"] <= rel and r["dw"] <= rel, r


def test_a_rank_without_tokens_gets_empty_outputs_and_zero_grads(results):
    """No token for any local expert (grouped_mm takes no empty operand): what the loop gives."""
    r = results["no-tokens"]
    assert r["shape"] == [0, 64] and r["grad_norm"] == 0.0 and r["dw"] == 0.0, r


def test_overlapped_param_all_gathers_are_waited_on_as_the_loop_waits(results):
    """--overlap-param-gather: the grouped GEMM never calls the expert modules, so the seam runs their
    pre-hooks, where DDP waits on each all-gather; without that the experts' all-gathers stay pending and
    the next iteration's dispatch asserts (seen on a TP2 PP8 VPP4 EP32 target)."""
    loop, grouped = results["overlap"]["loop"], results["overlap"]["grouped"]
    assert loop["error"] is None and loop["pending"] == [0, 0, 0], loop
    assert grouped == loop, grouped


def test_a_hook_the_grouped_gemm_cannot_run_is_refused_by_name(results):
    r = results["post-hook"]
    assert "refused" in r, r
    assert "a forward or backward hook on local_experts.1.linear_fc2" in r["refused"], r


def test_padding_between_experts_is_refused_by_name(results):
    r = results["padded"]
    assert "refused" in r, r
    assert "uneven distances" in r["refused"] and "--prism-experts megatron" in r["refused"]


def _same_training(loop: dict, grouped: dict) -> None:
    """Every rank's losses and grad norm at every iteration equal the loop's (fp32, to rounding)."""
    assert loop["metrics"] and loop["metrics"].keys() == grouped["metrics"].keys()
    for key, (losses, norm) in loop["metrics"].items():
        other, other_norm = grouped["metrics"][key]
        assert losses.keys() == other.keys(), key
        for name, value in losses.items():
            assert abs(other[name] - value) <= 1e-5 * max(1.0, abs(value)), (key, name, value, other[name])
        if norm is not None:
            assert abs(other_norm - norm) <= 1e-5 * max(1.0, abs(norm)), (key, norm, other_norm)


def test_a_mini_moe_recipe_trains_the_same_with_grouped_experts(megatron_runs):
    """mini-moe-ep2 (EP2: 2 local experts a rank; without biases, which the seam refuses) end to end: the
    same losses and grad norms with --prism-experts grouped (fp32, to rounding)."""
    loop = megatron_runs.run("mini-moe-ep2", "off", "--disable-bias-linear")
    grouped = megatron_runs.run("mini-moe-ep2", "off", "--disable-bias-linear", "--prism-experts", "grouped")
    _same_training(loop, grouped)


def test_an_interleaved_moe_with_overlapped_param_gather_trains_the_same_with_grouped_experts(megatron_runs):
    """Megatron-LM's trainer, TP1·PP2·VPP2·EP4 (expert DP 1), distributed optimizer with overlapped grad
    reduce and param gather: the interleaved schedule dispatches every all-gather at an iteration's start,
    so an all-gather the grouped experts never waited on fails the third iteration. Three iterations,
    the loop's losses and grad norms."""
    from prism_megatron.megatron.megatron_lm import training_available

    if not training_available():
        pytest.skip("the training driver is Megatron-LM's trainer's (megatron.training not found)")
    flags = ("--disable-bias-linear", "--use-distributed-optimizer", "--overlap-grad-reduce",
             "--overlap-param-gather", "--num-layers-per-virtual-pipeline-stage", "1")
    loop = megatron_runs.run("mini-moe-ep4-tp1pp2", "off", *flags, driver="training", memory=False)
    grouped = megatron_runs.run("mini-moe-ep4-tp1pp2", "off", *flags, "--prism-experts", "grouped",
                                driver="training", memory=False)
    _same_training(loop, grouped)
    assert {iteration for _, iteration in grouped["metrics"]} == {1, 2, 3}


def test_the_fake_process_group_anchor_runs_the_grouped_program(megatron_runs):
    """--prism-anchor-fake-pg runs each class's rank alone with prism's rendering seams: with grouped experts
    the anchor's model is the grouped one, and the file says which seams it ran with."""
    run = megatron_runs.run("mini-moe-ep2", "off", "--disable-bias-linear", "--prism-experts", "grouped",
                            "--prism-anchor-fake-pg")
    anchor = json.loads((run["trace"] / "fake-pg-anchor.json").read_text())
    assert anchor["ranks"], anchor
    for entry in anchor["ranks"]:
        assert "error" not in entry and entry["max_allocated"] > 0, entry
        assert "experts grouped" in entry["rendered"], entry
    plain = megatron_runs.run("mini-moe-ep2", "off", "--disable-bias-linear", "--prism-anchor-fake-pg")
    for entry in json.loads((plain["trace"] / "fake-pg-anchor.json").read_text())["ranks"]:
        assert "experts grouped" not in entry["rendered"], entry


def test_the_option_records_its_substitution(tmp_path):
    from prism_megatron.megatron.run import parse_run_args

    script = tmp_path / "pretrain_gpt.py"  # a target recipe runs Megatron-LM's script, not the core driver
    script.write_text("")
    target = "deepseek-v3-h100x1024"
    request = parse_run_args(["--recipe", target, "--prism-experts", "grouped", str(script)])
    entries = [s for s in request.substitutions if s["setting"] == "--moe-grouped-gemm"]
    assert len(entries) == 1 and "grouped_mm" in entries[0]["rendered"], request.substitutions
    assert entries[0]["published"].startswith("on")  # the target's setting, as the recipe says it
    assert request.env["PRISM_EXPERTS"] == "grouped"
    mini = parse_run_args(["--recipe", "mini-moe-ep2", "--prism-experts", "grouped"])  # asks no grouped GEMM
    assert [s["setting"] for s in mini.substitutions] == ["local experts (--prism-experts grouped)"]
    plain = parse_run_args(["--recipe", target, "--prism-experts", "megatron", str(script)])  # Megatron's loop
    assert "PRISM_EXPERTS" not in plain.env
    assert [s for s in plain.substitutions if s["setting"] == "--moe-grouped-gemm"][0]["rendered"].startswith("off")


def test_a_te_recipe_names_the_optimizer_step_megatron_falls_back_to_here(tmp_path, monkeypatch):
    """A target recipe publishes Transformer Engine, whose FusedAdam and fused clip kernels Megatron uses; where
    neither TE nor apex's optimizers are importable, Megatron runs torch's foreach Adam and its local clip: the
    report's substitutions say so. Not for a recipe without a published TE stack, nor where a fused Adam is."""
    import importlib.util

    from prism_megatron.megatron.run import OPTIMIZER_FALLBACK, parse_run_args

    fused = {"transformer_engine": None, "apex.optimizers": None}  # what the environment offers Megatron
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: fused[name] if name in fused else real(name, *a))
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")

    def named(*args: str) -> list[dict]:
        return [s for s in parse_run_args(list(args)).substitutions if s["setting"] == OPTIMIZER_FALLBACK["setting"]]

    target = ["--recipe", "llama3-70b-h100x64"]
    assert named(*target, "--prism-optimizer", "megatron", str(script)) == [OPTIMIZER_FALLBACK]
    assert "foreach" in OPTIMIZER_FALLBACK["rendered"] and "FusedAdam" in OPTIMIZER_FALLBACK["published"]
    assert named("--recipe", "mini-moe-ep2") == []  # a mini recipe publishes no TE stack
    rendered = parse_run_args([*target, str(script)])  # the target recipes choose the fused step themselves
    assert rendered.options["prism_optimizer"] == "fused" and rendered.env["PRISM_OPTIMIZER"] == "fused"
    assert any("emulation.optimizer" in n for n in rendered.notes)
    entry, = [s for s in rendered.substitutions if s["setting"] == OPTIMIZER_FALLBACK["setting"]]
    assert entry["published"] == OPTIMIZER_FALLBACK["published"] and "--prism-optimizer fused" in entry["rendered"]
    fused["apex.optimizers"] = object()
    assert named(*target, "--prism-optimizer", "megatron", str(script)) == []
    kept = parse_run_args([*target, "--prism-optimizer", "fused", str(script)])
    assert "PRISM_OPTIMIZER" not in kept.env and any("--prism-optimizer fused not needed" in n for n in kept.notes)


def test_the_ranks_run_the_seam_and_refuse_expert_biases_by_name(megatron_runs):
    """mini-moe-ep2 as shipped has expert biases: the ranks' seam (so it is installed there) refuses them."""
    run = megatron_runs.run("mini-moe-ep2", "off", "--prism-experts", "grouped", check=False)
    assert run["code"] != 0
    assert "--prism-experts grouped does not take expert biases (local_experts.0.linear_fc1.bias)" in run["output"]
