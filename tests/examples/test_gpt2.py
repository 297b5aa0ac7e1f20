"""The worked example of docs/adding-a-model.md: GPT-2 (examples/gpt2.py) against
transformers' GPT-2 at world 1, then on real gloo ranks against world 1."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from checkpoints import hf_oracle
from distributed.pool import get_pool

import gpt2
from layer_boundary.models.config import CheckpointError
from layer_boundary.models.loader import iter_weights
from layer_boundary.runtime.args import BoundaryRuntime
from layer_boundary.runtime.invariant import batch_invariant
from layer_boundary.runtime.parallel import ParallelDims, build_parallel

TINY = gpt2.TINY
PROMPTS = ((1, 2, 3, 4, 5), (7, 8, 9), (50, 3, 17, 88, 2, 61, 33))
STEPS = 4  # step 0 is the prefill, the rest are KV-cache decode steps


def hf_gpt2(path: Path, *, seed: int = 0, **overrides) -> Path:
    """save_pretrained of a random transformers GPT2LMHeadModel (the example's own)."""
    return Path(gpt2.tiny_checkpoint(path, seed=seed, **overrides))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    return hf_gpt2(tmp_path_factory.mktemp("gpt2"))


def world1_runtime() -> BoundaryRuntime:
    return BoundaryRuntime(build_parallel(ParallelDims()))


# -- world 1 against transformers


def assert_matches_hf(path: Path, prompts=PROMPTS, steps: int = STEPS) -> None:
    """Prefill and KV-cache decode logits within 1e-5 of transformers' full-sequence forward
    at the same positions; greedy tokens equal to its argmax."""
    run = gpt2.run_rank(str(path), prompts, steps)
    ref = hf_oracle("GPT2LMHeadModel", path)
    for j, prompt in enumerate(prompts):
        ids = torch.tensor([list(prompt) + run["generated"][j][:-1]])
        with torch.no_grad():
            expected = ref(ids).logits[0]
        for step in range(steps):
            pos = len(prompt) - 1 + step
            diff = (expected[pos] - run["logits"][j][step]).abs().max().item()
            assert diff <= 1e-5, f"prompt {j} step {step}: max abs diff {diff}"
        assert run["generated"][j] == expected[len(prompt) - 1:].argmax(-1).tolist()
    assert run["released"] and run["modes"] == ["ar"] * steps


def test_world1_matches_transformers_prefill_and_decode(gpt2_dir):
    assert_matches_hf(gpt2_dir)


@pytest.mark.parametrize("overrides", [
    {"tie_word_embeddings": False, "scale_attn_weights": False},
    {"n_inner": 96, "scale_attn_by_inverse_layer_idx": True, "activation_function": "gelu"},
], ids=["untied-unscaled", "inner96-inverse-layer-scaling-exact-gelu"])
def test_world1_matches_transformers_config_variants(tmp_path, overrides):
    assert_matches_hf(hf_gpt2(tmp_path, seed=1, **overrides))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_plain_layernorm_reads_the_rounded_sum(dtype):
    """nn.LayerNorm has no normalize_fp32: the boundary wraps it to normalise the fp32 sum
    rounded to the model dtype (transformers' order: add, round, norm). In fp32 the rounding
    is the identity, hence the parity above."""
    cfg = gpt2.GPT2Config.from_dict(dict(TINY, model_type="gpt2"))
    block = gpt2.GPT2LMHeadModel(cfg, world1_runtime(), dtype).transformer.h[0]
    wrapped = block.ffn_boundary.norm
    assert not hasattr(block.ln_2, "normalize_fp32") and wrapped.norm is block.ln_2
    x32 = torch.randn(5, cfg.n_embd)
    with torch.no_grad():
        out = wrapped.normalize_fp32(x32, dtype)
        assert out.dtype == dtype and torch.equal(out, block.ln_2(x32.to(dtype)))


def test_hub_layout_loads_the_same_model(gpt2_dir):
    """The hub's files carry no ``transformer.`` prefix and store the causal-mask buffers:
    checkpoint_name maps the one and drops the other."""
    cfg = gpt2.GPT2Config.from_dict(dict(TINY, model_type="gpt2"))
    ours = gpt2.load_gpt2(gpt2_dir, world1_runtime())

    def hub_layout():
        for name, tensor in iter_weights(gpt2_dir):
            yield name.removeprefix("transformer."), tensor
        for i in range(cfg.n_layer):
            yield f"h.{i}.attn.bias", torch.tril(torch.ones(1, 1, 32, 32))
            yield f"h.{i}.attn.masked_bias", torch.tensor(-1e4)

    hub = gpt2.GPT2LMHeadModel(cfg, world1_runtime())
    hub.load_weights(hub_layout())
    for (name, a), (_, b) in zip(ours.named_parameters(), hub.named_parameters()):
        assert torch.equal(a, b), name


def test_load_errors_name_the_tensor_on_disk(gpt2_dir):
    model = gpt2.GPT2LMHeadModel(gpt2.GPT2Config.from_dict(dict(TINY, model_type="gpt2")),
                                 world1_runtime())
    weights = dict(iter_weights(gpt2_dir))
    name = "transformer.h.1.attn.c_attn.weight"
    bad = {**weights, name: weights[name].t()}  # stored as a linear, not a Conv1D
    with pytest.raises(CheckpointError, match=rf"checkpoint tensor {name} \(shape \(192, 64\)\)"):
        model.load_weights(bad.items())
    missing = {k: v for k, v in weights.items() if k != "transformer.ln_f.bias"}
    with pytest.raises(CheckpointError, match=r"lacks tensors for parameters "
                                              r"\['transformer.ln_f.bias'\]"):
        model.load_weights(missing.items())


@pytest.mark.parametrize("raw,message", [
    ({"activation_function": "relu"}, "activation_function 'relu' is not supported"),
    ({"add_cross_attention": True}, "add_cross_attention=true is not supported"),
    ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=true is not supported"),
    ({"n_head": "4"}, "field n_head must be a positive integer, got '4'"),
    ({"n_embd": 60}, "n_embd=60 is not divisible by n_head=8"),
])
def test_config_refuses_what_it_does_not_compute(raw, message):
    cfg = {**TINY, "model_type": "gpt2", "n_head": 8, **raw}
    with pytest.raises(CheckpointError, match=message):
        gpt2.GPT2Config.validate(cfg)
        gpt2.GPT2Config.from_dict(cfg)


def test_check_parallel_names_the_field():
    cfg = gpt2.GPT2Config.from_dict(dict(TINY, model_type="gpt2", n_inner=96))
    with pytest.raises(ValueError, match="n_head=4 is not divisible by attention tp=8"):
        gpt2.check_parallel(cfg, ParallelDims(world_size=8, tp=8))
    with pytest.raises(ValueError, match="n_inner=96 is not divisible by tp=64"):
        gpt2.check_parallel(cfg, ParallelDims(world_size=64, tp=64, attn_dp=16))


# -- multi-rank against world 1, on real gloo ranks


@functools.cache
def world1(path: str, prompts: tuple) -> dict:
    return gpt2.run_rank(path, prompts, STEPS)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dp,policy,mode", [
    (1, "ar", "ar"), (1, "rs", "rs"),  # tp 2: heads and MLP columns over both ranks
    (2, "ar", "ar"), (2, "rs", "rs"),  # attention DP 2: attention TP 1, the MLP over TP 2
    (2, "auto", "rsv"),  # auto: BOUNDARY_REDUCTION, rs+rsv, takes rsv under attention DP
])
def test_tp2_matches_world1(gpt2_dir, dp, policy, mode):
    # under attention DP a single request leaves DP rank 1 with no tokens: it still joins
    # every collective (the MLP's input gather and its sum)
    prompts = PROMPTS if dp == 1 else PROMPTS[2:]
    results = get_pool(2).run(gpt2.run_rank, str(gpt2_dir), prompts, STEPS, tp=2, dp=dp,
                              boundary_reduction=policy)
    ref = world1(str(gpt2_dir), prompts)
    by_request = {}
    for r in results:
        assert r["released"], f"rank {r['rank']} left a residual stream open"
        assert r["modes"] == [mode] * STEPS, (r["rank"], r["modes"])
        assert r["heads"] == TINY["n_head"] // (2 // dp)  # heads over attention TP
        scatters = any(kind == "reduce_scatter" for kind, _, _ in r["collectives"])
        assert scatters == (mode != "ar"), r["collectives"]
        if r["attn_tp_rank"] == 0:
            for j, req in enumerate(r["requests"]):
                by_request[req] = (r["generated"][j], r["logits"][j])
    if dp == 2:
        assert results[1]["requests"] == []
    assert sorted(by_request) == list(range(len(prompts)))
    for j in range(len(prompts)):
        generated, logits = by_request[j]
        for step, (a, b) in enumerate(zip(logits, ref["logits"][j])):
            diff = (a - b).abs().max().item()
            assert diff <= 1e-5, f"request {j} step {step}: max abs diff {diff}"
        assert generated == ref["generated"][j]


def _invariant_run(path: str, prompts, tp: int = 1, on: bool = True) -> dict:
    with batch_invariant(on):
        return gpt2.run_rank(path, prompts, STEPS, tp=tp)


def _alone_and_batched(path: str, tp: int, on: bool = True) -> list[str]:
    """Where each prompt's logits run alone differ in any bit from the same prompt's in the
    batch (rank 0's view: every rank holds every request at dp 1)."""
    if tp == 1:
        batched = _invariant_run(path, PROMPTS, on=on)
        alone = [_invariant_run(path, (p,), on=on) for p in PROMPTS]
    else:
        batched = get_pool(tp).run(_invariant_run, path, PROMPTS, tp, on)[0]
        alone = [get_pool(tp).run(_invariant_run, path, (p,), tp, on)[0] for p in PROMPTS]
    return [f"prompt {j} step {step}" for j, run in enumerate(alone)
            for step, (a, b) in enumerate(zip(run["logits"][0], batched["logits"][j]))
            if not torch.equal(a, b)]


@pytest.mark.parametrize("tp", [1, 2])
def test_the_example_is_batch_invariant_in_the_mode_unchanged(gpt2_dir, tp):
    """An outside model with no word of the mode in it: inside ``batch_invariant()`` the
    ops run a row at a time and its attention a request a call, so each prompt's logits are
    the same bits alone as in the batch, at world 1 and over two gloo ranks."""
    assert _alone_and_batched(str(gpt2_dir), tp) == []


def test_the_example_off_the_mode_is_not(tmp_path):
    # the check means something: at an MLP width off the CPU loop's vector step (40) the
    # batch changes some prompt's last bits when the mode is off
    path = str(hf_gpt2(tmp_path / "gpt2", n_inner=40))
    assert _alone_and_batched(path, 1, on=False)
    assert _alone_and_batched(path, 1) == []


@pytest.mark.timeout(120)
def test_the_example_says_what_it_did_when_run_on_its_own():
    import subprocess
    import sys

    # one rank: the tensor-parallel runs are the cases above, on the pool
    out = subprocess.run([sys.executable, gpt2.__file__], capture_output=True, text=True,
                         check=True, timeout=100).stdout.splitlines()
    assert out[0] == "GPT-2 at tp 1 (random tiny checkpoint), row modes ['ar', 'ar', 'ar', 'ar']:"
    assert len(out) == 3 and all(line.endswith("(transformers: the same)") for line in out[1:])
