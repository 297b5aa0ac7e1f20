"""Compiled forwards: a whole Qwen3 forward (every decoder layer, its boundaries, the final
norm) traces under ``torch.compile(fullgraph=True)``, where any graph break is an error, and
gives the eager world-1 numbers, at world 1 and across gloo ranks.

The ``eager`` and ``aot_eager`` backends trace the same graph as inductor without generating
kernels, so they pin fullgraph cheaply; one inductor run shows the real path end to end.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from distributed.checks import assert_logits_match
from distributed.pool import get_pool

from distributed.checks import cli_ok
from layer_boundary.engine.runner import RunSpec, merge, run_rank

PROMPTS = ((1, 2, 3, 4, 5), (7, 11, 13), (42, 17, 5, 9))


def _eager_world1(spec: RunSpec):
    return merge([run_rank(replace(spec, tp=1, dp=1, ep=1, boundary_reduction="ar",
                                   compile=None, sequence_parallel=False,
                                   attn_input_scattered=False), world_size=1)])


def _spec(qwen3_dir, tp, dp, policy, backend):
    return RunSpec(str(qwen3_dir), tp=tp, dp=dp, boundary_reduction=policy, prompts=PROMPTS,
                   max_new_tokens=3, compile=backend)


@pytest.mark.timeout(240)
def test_fullgraph_at_world1(qwen3_dir):
    spec = _spec(qwen3_dir, 1, 1, "ar", "eager")
    compiled = run_rank(spec, world_size=1)
    assert compiled.streams_released and compiled.modes == ["ar"] * 3
    assert_logits_match(merge([compiled]), _eager_world1(spec), len(PROMPTS))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,policy,backend", [(2, 1, "rs", "eager"),
                                                   (2, 2, "rsv", "aot_eager")])
def test_fullgraph_across_ranks(qwen3_dir, tp, dp, policy, backend):
    spec = _spec(qwen3_dir, tp, dp, policy, backend)
    results = get_pool(tp).run(run_rank, spec, timeout=240)
    assert all(r.modes == [policy] * 3 and r.streams_released for r in results)
    assert_logits_match(merge(results), _eager_world1(spec), len(PROMPTS))


@pytest.mark.timeout(600)
def test_inductor_run_command(qwen3_dir, capsys):
    """``layer-boundary run --compile`` as a user runs it: inductor kernels on spawned ranks
    (each runs ``run_rank``, as a world-1 run does in-process), checked against the eager
    world-1 run. Two one-token prompts: the prefill and the decode step are two rows each,
    one bucket, so one inductor graph runs both forward modes (its kernels take a quarter of
    a minute to build on this machine)."""
    import json

    out = cli_ok(["run", "--model", str(qwen3_dir), "--tp", "2", "--compile", "--json",
                  "--prompt-ids", "3", "--prompt-ids", "5", "--max-new-tokens", "2"], capsys)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["compile"] == "inductor" and report["compiled_graphs"] == 1
    assert report["parity"]["tokens_match"] and report["parity"]["max_abs_diff"] <= 1e-5


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    from checkpoints.ds import hf_deepseek_v3

    return hf_deepseek_v3(tmp_path_factory.mktemp("ds_compile"))


@pytest.mark.timeout(240)
def test_fullgraph_moe_models(qwen3_moe_dir, deepseek_dir):
    """MoE layers hold no data-dependent shapes while compiling (experts run masked), so the
    MoE models trace whole too: DeepSeek-V3 at world 1 (with and without its LOCAL_TAIL
    shared experts), Qwen3-MoE at tp=2 with expert parallelism."""
    for model_dir, options in ((deepseek_dir, ()), (deepseek_dir, (("shared_experts_tp1", True),))):
        spec = replace(_spec(model_dir, 1, 1, "ar", "eager"), model_options=options)
        assert_logits_match(merge([run_rank(spec, world_size=1)]), _eager_world1(spec),
                            len(PROMPTS))
    spec = replace(_spec(qwen3_moe_dir, 2, 1, "rs", "eager"), ep=2)
    assert_logits_match(merge(get_pool(2).run(run_rank, spec, timeout=240)),
                        _eager_world1(spec), len(PROMPTS))


@pytest.mark.timeout(240)
def test_fullgraph_scattered_variants(qwen3_dir, deepseek_dir):
    """A sequence-parallel prefill (the scope's gathers and reduce-scatters inside the
    linears) and input-scattered attention (the MLA latent before its gather) trace whole."""
    for spec in (replace(_spec(qwen3_dir, 2, 1, "rs", "eager"), sequence_parallel=True),
                 replace(_spec(deepseek_dir, 2, 1, "rs", "eager"), attn_input_scattered=True)):
        results = get_pool(2).run(run_rank, spec, timeout=240)
        assert all(r.modes == ["rs"] * 3 and r.streams_released for r in results)
        assert_logits_match(merge(results), _eager_world1(spec), len(PROMPTS))


@pytest.mark.timeout(240)
def test_run_compile_reports_one_graph_per_bucket(qwen3_dir, capsys):
    """Prefill (15 rows) pads to the 16-row bucket and decode (3 rows) to the 4-row one: two
    graphs on every rank, reported by ``run --compile`` (the ladder's other buckets:
    tests/models/test_compiled_buckets.py)."""
    import json

    out = cli_ok(["run", "--model", str(qwen3_dir), "--tp", "2", "--compile-backend", "eager",
                  "--max-new-tokens", "3", "--json"], capsys)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["compiled_graphs"] == 2 and report["parity"]["tokens_match"]


def test_the_constant_mark_is_the_one_torch_sets():
    """The package marks its trace-time placement as a constant result without importing
    torch's compiler: the mark must be exactly what ``torch.compiler`` sets."""
    from layer_boundary.construction import _constant_result

    def theirs():
        pass

    def ours():
        pass

    torch.compiler.assume_constant_result(theirs)
    _constant_result(ours)
    assert vars(ours) == vars(theirs) != {}


def test_importing_the_engine_leaves_torch_compiler_and_triton_unimported():
    """Every rank and the command line import the package: torch's compiler (and triton,
    which it imports) cost seconds of CPU there, and decide the Triton interpreter too early."""
    code = ("import sys, layer_boundary, layer_boundary.engine.runner, layer_boundary.engine.cli; "
            "print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def _tiny_qwen3():
    from layer_boundary.engine.bench import _random_model
    from layer_boundary.models.qwen3 import Qwen3Config

    return _random_model(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=8))


@pytest.mark.timeout(240)
def test_the_guard_filter_drops_the_model_tensors_reached_through_a_plan_and_nothing_else(
        monkeypatch):
    """A compiled forward keeps the guards on the batch's tensors and on the parameters reached
    through the modules; a parameter of the model reached through a boundary's plan (a fused
    norm's weight) is read as a graph input every call without a guard of its own: a new
    value written into it is what the next call computes with."""
    from layer_boundary.engine.compiled import compile_forward
    from layer_boundary.runtime import ForwardBatch, ForwardMode
    from layer_boundary.stage import boundary_guard_filter

    model = _tiny_qwen3()
    inner = boundary_guard_filter(model)
    seen = []

    def recording(entries):
        kept = inner(entries)
        seen.extend(zip(entries, kept))
        return kept

    monkeypatch.setattr("layer_boundary.engine.compiled.boundary_guard_filter",
                        lambda m: recording)
    forward = compile_forward(model, "eager", padded=True)
    cache = model.make_kv_cache(2, 8)

    def batch():
        return ForwardBatch.build(ForwardMode.EXTEND, [[1, 2, 3], [4, 5, 6]], [0, 0],
                                  kv_cache=cache)

    with torch.no_grad():
        forward(batch())
        owned = {id(t) for t in model.parameters()}
        through = [(e, k) for e, k in seen if e.guard_type == "TENSOR_MATCH"
                   and "_boundary." in e.name]
        assert through and all(id(e.value) in owned and not k for e, k in through)
        kept = [e.name for e, k in seen if k and e.guard_type == "TENSOR_MATCH"]
        assert any("forward_batch" in n for n in kept)
        assert any("qkv_proj" in n and "_parameters" in n for n in kept)
        assert any(e.guard_type == "EQUALS_MATCH" and "._traced[" in e.name and k
                   for e, k in seen)  # the kept placement's check stays
        norm = model.model.layers[0].input_layernorm.weight
        assert any(e.value is norm for e, _ in through)
        norm.mul_(1.5)  # in place: the same input, new values
        torch.testing.assert_close(forward(batch()), model(batch()), atol=1e-5, rtol=0)


def test_the_guard_filter_keeps_a_foreign_tensor_reached_through_a_plan():
    """Only the model's own tensors lose their guard under a plan; any other tensor a plan
    holds keeps it, as do guards outside the boundaries."""
    from torch._dynamo.types import GuardFilterEntry

    from layer_boundary.stage import boundary_guard_filter

    model = _tiny_qwen3()
    keep = boundary_guard_filter(model)
    weight = model.model.layers[0].input_layernorm.weight
    plan = "L['self']._modules['model']._modules['layers']._modules['0'].attn_boundary.plan"

    def entry(name, value, kind="TENSOR_MATCH"):
        return GuardFilterEntry(name=name, has_value=True, value=value, guard_type=kind,
                                derived_guard_types=(), is_global=False, orig_guard=None)

    entries = [entry(plan + ".norm._parameters['weight']", weight),
               entry(plan + ".scratch", torch.zeros(2)),
               entry("L['self']._modules['model']._modules['norm']._parameters['weight']",
                     model.model.norm.weight),
               entry(plan + ".mode", "ar", "EQUALS_MATCH"),
               entry(plan + "._traced[(3,)][1]", 3, "EQUALS_MATCH")]
    assert keep(entries) == [False, True, True, False, True]
