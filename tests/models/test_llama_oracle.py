"""Llama and Mistral at world 1 against transformers (fp32, eager attention): prefill logits
and KV-cache decode steps within 1e-5, for GQA with tied and untied heads, the default and
Llama 3 rope, attention and MLP biases, and Mistral with and without a sliding window shorter
than the prompts; plus the config facts the oracle runs cannot show."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from checkpoints import with_config
from checkpoints.llama import (LLAMA3_ROPE, WINDOW, hf_llama, hf_llama_reference, hf_mistral,
                               hf_mistral_reference)

from layer_boundary.models import load_config, load_model, model_class
from layer_boundary.models.config import CheckpointError
from layer_boundary.engine.generate import greedy_generate
from layer_boundary.engine.runner import check_draft
from layer_boundary.runtime.args import BoundaryRuntime
from layer_boundary.runtime.parallel import ParallelDims, build_parallel

# the longest is 7 tokens: with 4 decode steps, its last queries are 10 positions past the
# first key, beyond Mistral's window of 4
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 88, 2, 61, 33]]
STEPS = 4

VARIANTS = {
    "llama-untied": (hf_llama, hf_llama_reference, {}),
    "llama-tied-llama3": (hf_llama, hf_llama_reference, dict(seed=1, tie=True, llama3=True)),
    "llama-biases-llama3": (hf_llama, hf_llama_reference,
                            dict(seed=2, llama3=True, attention_bias=True, mlp_bias=True)),
    "llama-mha-tied": (hf_llama, hf_llama_reference,
                       dict(seed=3, tie=True, num_key_value_heads=8, rope_theta=1e6)),
    "mistral-window": (hf_mistral, hf_mistral_reference, {}),
    "mistral-window-tied": (hf_mistral, hf_mistral_reference, dict(seed=4, tie=True)),
    "mistral-no-window": (hf_mistral, hf_mistral_reference,
                          dict(seed=5, sliding_window=None, rope_theta=1e6)),
}


def world1():
    return BoundaryRuntime(build_parallel(ParallelDims()))


def assert_matches(path, reference, prompts=PROMPTS, steps=STEPS):
    """Greedy generation at world 1 (a prefill, then KV-cache decode steps) against the whole
    sequence through transformers: position p's logits predict token p+1."""
    gen = greedy_generate(load_model(path, world1()), prompts, steps)
    ref = reference(path)
    for j, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = ref(torch.tensor([prompt + gen.generated[j][:-1]])).logits[0]
        for step in range(steps):
            got = gen.logits[j][step]
            diff = (expected[len(prompt) - 1 + step] - got).abs().max().item()
            assert diff <= 1e-5, f"prompt {j} step {step}: max abs diff {diff}"
        assert gen.generated[j] == expected[len(prompt) - 1:].argmax(-1).tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_world1_matches_transformers_prefill_and_decode(tmp_path, variant):
    write, reference, kwargs = VARIANTS[variant]
    assert_matches(write(tmp_path / variant, **kwargs), reference)


def test_llama3_frequencies_are_transformers_own(tmp_path):
    """The scaled inverse frequencies equal transformers' to the bit, and the scaling moved
    some (so the llama3 variants test something the default rope would not)."""
    path = hf_llama(tmp_path / "llama3", llama3=True)
    cfg = load_config(path)
    ours = cfg.inverse_frequencies()
    theirs = hf_llama_reference(path).model.rotary_emb.inv_freq
    assert torch.equal(ours, theirs)
    plain = 1.0 / (LLAMA3_ROPE["rope_theta"] ** (torch.arange(0, cfg.head_dim, 2).float()
                                                 / cfg.head_dim))
    kept = ours == plain
    divided = torch.isclose(ours, plain / LLAMA3_ROPE["factor"], rtol=1e-6, atol=0)
    assert kept.any() and divided.any() and (~kept & ~divided).any()  # all three bands


def test_the_window_changes_what_mistral_computes(tmp_path):
    """The same weights with and without the window differ once a prompt outgrows it (so the
    windowed oracle runs check the window, not just full attention)."""
    path = hf_mistral(tmp_path / "windowed")
    full = tmp_path / "full"
    shutil.copytree(path, full)
    cfg = json.loads((full / "config.json").read_text())
    (full / "config.json").write_text(json.dumps(dict(cfg, sliding_window=None)))
    prompt = [PROMPTS[2]]
    a = greedy_generate(load_model(path, world1()), prompt, 1).logits[0][0]
    b = greedy_generate(load_model(full, world1()), prompt, 1).logits[0][0]
    assert len(prompt[0]) > WINDOW and (a - b).abs().max() > 1e-3


def test_a_mistral_draft_is_refused_and_a_llama_draft_is_not(tmp_path):
    llama, mistral = hf_llama(tmp_path / "llama"), hf_mistral(tmp_path / "mistral")
    dims = ParallelDims()
    check_draft(load_config(llama), load_config(llama), model_class("llama"), dims)
    with pytest.raises(ValueError, match="positional KV cache"):
        check_draft(load_config(llama), load_config(mistral), model_class("mistral"), dims)


@pytest.mark.parametrize("fields,message", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_type 'yarn' is not supported"),
    ({"rope_parameters": {**LLAMA3_ROPE, "high_freq_factor": 1.0}},
     "high_freq_factor=1.0 must exceed low_freq_factor=1.0"),
    ({"rope_parameters": {k: v for k, v in LLAMA3_ROPE.items() if k != "factor"}},
     "rope_parameters has no factor"),
    ({"mlp_bias": "false"}, "mlp_bias must be true or false"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
])
def test_a_config_it_cannot_run_is_refused_by_name(tmp_path, fields, message):
    src = (hf_mistral if "sliding_window" in fields else hf_llama)(tmp_path / "src")
    with pytest.raises(CheckpointError, match=message):
        load_config(with_config(src, tmp_path / "bad", **fields))


def test_old_style_rope_scaling_reads_like_rope_parameters(tmp_path):
    """A config.json from before rope_parameters: rope_theta on top, llama3 in rope_scaling,
    without original_max_position_embeddings (max_position_embeddings then)."""
    path = hf_llama(tmp_path / "new", llama3=True)
    new = load_config(path)
    old_rope = {k: v for k, v in LLAMA3_ROPE.items()
                if k not in ("rope_theta", "original_max_position_embeddings")}
    old = load_config(with_config(path, tmp_path / "old", rope_parameters=None,
                                  rope_scaling=old_rope, rope_theta=LLAMA3_ROPE["rope_theta"],
                                  max_position_embeddings=1024))
    assert old.rope_theta == new.rope_theta and old.rope == new.rope
