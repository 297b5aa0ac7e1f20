"""Greedy speculative decoding: for every reference target, with a small Qwen3 draft of the
same vocabulary, at tp 1, tp 2 and tp=4 dp=2 under rsv with the draft under ar, the emitted
tokens and the logits at every emitted position are target-only decoding's (world 1, itself
proven against transformers; the prefill against transformers here too). Drafts that agree
with the target (itself, a perturbed copy) exercise acceptance; targets whose caches fold
every token in (Nemotron-H's Mamba states, DeepSeek-V4's window ring) exercise the rollback."""

from __future__ import annotations

import shutil

import pytest
import torch
from checkpoints import hf_qwen3

from layer_boundary.engine.runner import RunSpec, merge, speculative_summary

from .checks import assert_logits_match, world1
from .models import MODELS, PROMPTS, transformers_prefill
from .pool import get_pool

STEPS = 5  # emitted tokens per request
DRAFT_STEPS = 3

# (tp, dp, target policy, draft policy)
TOPOLOGIES = {"tp1": (1, 1, "ar", "auto"), "tp2": (2, 1, "auto", "auto"),
              "tp4-dp2-rsv": (4, 2, "rsv", "ar")}


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A one-layer Qwen3 of the targets' vocabulary (96)."""
    return str(hf_qwen3(tmp_path_factory.mktemp("draft"), seed=7, num_hidden_layers=1))


def run(spec: RunSpec):
    from layer_boundary.engine.runner import run_rank

    results = get_pool(spec.world_size).run(run_rank, spec)
    return results, merge(results)


# every model at world 1 and under attention DP with rsv; plain tp 2 (target and draft
# resolving auto to ar) once, on the dense model
RUNS = [(model, topology) for model in MODELS for topology in TOPOLOGIES
        if topology != "tp2" or model == "qwen3"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model,topology", RUNS, ids=[f"{m}-{t}" for m, t in RUNS])
def test_output_is_the_targets_greedy_decoding(model_dirs, draft_dir, model, topology):
    tp, dp, policy, draft_policy = TOPOLOGIES[topology]
    spec = RunSpec(model_dirs[model], tp=tp, dp=dp, boundary_reduction=policy,
                   prompts=PROMPTS, max_new_tokens=STEPS, draft_model=draft_dir,
                   speculative_steps=DRAFT_STEPS, speculative_boundary_reduction=draft_policy)
    results, out = run(spec)
    assert_logits_match(out, world1(spec), len(PROMPTS))
    for j, expected in enumerate(transformers_prefill(model, model_dirs[model])):
        assert (out.logits[j][0] - expected).abs().max().item() <= 1e-5, j
    summary = speculative_summary(results)
    assert summary["target_forwards"] >= 1
    if model in ("nemotron_h", "deepseek_v4"):  # a random draft is rejected: caches roll back
        assert summary["reruns"] >= 1


def perturbed_copy(src, dst, scale: float) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(3)
    tensors = load_file(f"{dst}/model.safetensors")
    save_file({k: v + scale * torch.randn(v.shape, generator=gen) * v.std()
               for k, v in tensors.items()}, f"{dst}/model.safetensors")
    return str(dst)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,dp,policy", [(1, 1, "ar"), (4, 2, "rsv")])
def test_drafts_that_agree_are_accepted(model_dirs, tmp_path, tp, dp, policy):
    """The target as its own draft: every proposal accepted, steps + 1 tokens per forward. A
    perturbed copy: some accepted, some not. The output is the target's either way."""
    target = model_dirs["qwen3"]
    rates = []
    for draft in (target, perturbed_copy(target, tmp_path / "near", 0.3)):
        spec = RunSpec(target, tp=tp, dp=dp, boundary_reduction=policy, prompts=PROMPTS,
                       max_new_tokens=9, draft_model=draft, speculative_steps=DRAFT_STEPS)
        results, out = run(spec)
        assert_logits_match(out, world1(spec), len(PROMPTS))
        rates.append(speculative_summary(results))
    assert rates[0]["acceptance_rate"] == 1.0
    assert rates[0]["tokens_per_target_forward"] == DRAFT_STEPS + 1
    assert 0 < rates[1]["acceptance_rate"] < 1, rates[1]


def test_bad_drafts_are_refused(model_dirs, draft_dir, tmp_path, capsys):
    from .checks import cli

    other_vocab = str(hf_qwen3(tmp_path / "v128", vocab_size=128, num_hidden_layers=1))
    three_heads = str(hf_qwen3(tmp_path / "h3", num_hidden_layers=1, num_attention_heads=3,
                               num_key_value_heads=1, head_dim=16))
    target = model_dirs["qwen3"]
    for draft, args in ((other_vocab, []), (three_heads, ["--tp", "2"]),
                        (model_dirs["nemotron_h"], [])):
        code, _ = cli(["run", "--model", target, "--draft-model", draft, "--tp", "1", "--dp",
                       "1", *args], capsys)
        assert code == 2  # a one-line error before any rank starts
    # the errors themselves (cli() returns stdout; the one-line error goes to stderr)
    from layer_boundary.models import load_config, model_class_of
    from layer_boundary.engine.runner import check_draft
    from layer_boundary.runtime import ParallelDims

    for draft, dims, message in (
            (other_vocab, ParallelDims(), "draft vocab_size=128 differs"),
            (three_heads, ParallelDims(world_size=2, tp=2), "num_attention_heads=3"),
            (model_dirs["nemotron_h"], ParallelDims(), "drafts need a positional KV cache")):
        with pytest.raises(ValueError, match=message):
            check_draft(load_config(target), load_config(draft), model_class_of(draft), dims)
