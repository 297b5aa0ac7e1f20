"""Granite and GraniteMoE (``models/granite.py``, ``models/granitemoe.py``: the scaled
embedding, the attention multiplier as the softmax scale, the scaled residual update on both
stages, the logits divided) at world 1 against transformers (fp32, eager attention and
experts): prefill logits at every position and KV-cache decode steps within 1e-5. Granite
untied with every multiplier set, and tied with the llama3 rope, biases and a residual
multiplier of 1 (the plain add); GraniteMoE's top-k-then-softmax router and fused experts.
Configs it cannot run are refused by name."""

from __future__ import annotations

import pytest
from checkpoints import hf_oracle, with_config
from checkpoints.granite import hf_granite, hf_granitemoe
from oracle import assert_decode_matches, assert_prefill_matches, world1

from layer_boundary.models import load_config, load_model
from layer_boundary.models.config import CheckpointError
from layer_boundary.residual.scaled import ScaledAdd

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 33, 2, 61, 33]]
STEPS = 4
LLAMA3 = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# name: (writer, transformers class, overrides)
VARIANTS = {
    "granite": (hf_granite, "GraniteForCausalLM", {}),
    "granite-tied-llama3-biases-plain-residual": (hf_granite, "GraniteForCausalLM", dict(
        seed=1, tie_word_embeddings=True, rope_parameters=LLAMA3, attention_bias=True,
        mlp_bias=True, residual_multiplier=1.0)),
    "granitemoe": (hf_granitemoe, "GraniteMoeForCausalLM", {}),
}


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory):
    return hf_granite(tmp_path_factory.mktemp("granite") / "granite")


@pytest.fixture(scope="module")
def granitemoe_dir(tmp_path_factory):
    return hf_granitemoe(tmp_path_factory.mktemp("granitemoe") / "granitemoe")


@pytest.mark.parametrize("variant", VARIANTS)
def test_world1_matches_transformers(tmp_path, granite_dir, granitemoe_dir, variant):
    write, hf_class, overrides = VARIANTS[variant]
    shared = {"granite": granite_dir, "granitemoe": granitemoe_dir}
    path = shared[variant] if variant in shared else write(tmp_path / variant, **overrides)
    ours, ref = load_model(path, world1()), hf_oracle(hf_class, path)
    assert_prefill_matches(ours, ref, PROMPTS)
    assert_decode_matches(ours, ref, PROMPTS, STEPS)


def test_each_multiplier_is_read_and_defaults_to_one(tmp_path, granite_dir):
    cfg = load_config(granite_dir)
    assert (cfg.embedding_multiplier, cfg.attention_multiplier, cfg.residual_multiplier,
            cfg.logits_scaling) == (4.0, 0.125, 0.22, 2.5)
    bare = load_config(with_config(granite_dir, tmp_path / "bare", drop=(
        "embedding_multiplier", "attention_multiplier", "residual_multiplier",
        "logits_scaling")))
    assert (bare.embedding_multiplier, bare.attention_multiplier, bare.residual_multiplier,
            bare.logits_scaling) == (1.0, 1.0, 1.0, 1.0)


def test_both_stages_declare_the_scaled_update(granite_dir):
    model = load_model(granite_dir, world1())
    layer = model.model.layers[0]
    for stage in (layer.attn_boundary, layer.ffn_boundary):
        update = stage.declaration.residual.update
        assert isinstance(update, ScaledAdd) and update.multiplier == 0.22


@pytest.mark.parametrize("fields,message", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"residual_multiplier": 0}, "field residual_multiplier must be a positive number"),
    ({"logits_scaling": "16"}, "field logits_scaling must be a positive number"),
    ({"attention_multiplier": True}, "field attention_multiplier must be a positive number"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
     "rope_type 'yarn' is not supported"),
])
def test_a_granite_config_it_cannot_run_is_refused_by_name(tmp_path, granite_dir, fields,
                                                           message):
    with pytest.raises(CheckpointError, match=message):
        load_config(with_config(granite_dir, tmp_path / "bad", **fields))


@pytest.mark.parametrize("fields,drop,message", [
    ({"num_experts_per_tok": 5}, (), "num_experts_per_tok=5 exceeds the 4 experts"),
    ({"num_experts_per_tok": 9}, ("num_local_experts",),
     "num_experts_per_tok=9 exceeds the 8 experts"),  # transformers' default count
    ({"num_local_experts": 0}, (), "field num_local_experts must be a positive integer"),
    ({"quantization_config": {"quant_method": "fp8"}}, (),
     "quantization_config is not supported"),
])
def test_a_granitemoe_config_it_cannot_run_is_refused_by_name(tmp_path, granitemoe_dir, fields,
                                                              drop, message):
    with pytest.raises(CheckpointError, match=message):
        load_config(with_config(granitemoe_dir, tmp_path / "bad", drop=drop, **fields))
