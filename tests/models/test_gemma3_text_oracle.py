"""Gemma-3 text (``models/gemma3_text.py``: sandwich norms, zero-centered norms, a scaled
embedding, sliding and full layers with their own ropes) at world 1 against transformers
(fp32, eager attention): prefill logits at every position and KV-cache decode steps against
transformers' cached decode within 1e-5, a window shorter than the prompts and their decode
steps; the legacy config fields read as transformers reads them; refusals named."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import hf_oracle, with_config
from checkpoints.gemma3 import WINDOW, hf_gemma3
from oracle import assert_decode_matches, assert_prefill_matches, world1

from layer_boundary.models import load_config, load_model
from layer_boundary.models.config import CheckpointError

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 33, 2, 61, 33]]
STEPS = 4
LINEAR = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}

VARIANTS = {
    "tied": {},
    # an untied, softcapped head, biases, exact gelu, a linear rope on the full layers, MHA
    "untied-softcap-linear": dict(
        seed=1, tie_word_embeddings=False, final_logit_softcapping=3.0, attention_bias=True,
        hidden_activation="gelu", num_key_value_heads=4, rope_parameters=LINEAR,
        query_pre_attn_scalar=16),
}


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return hf_gemma3(tmp_path_factory.mktemp("gemma3") / "tied")


@pytest.mark.parametrize("variant", VARIANTS)
def test_world1_matches_transformers(tmp_path, gemma3_dir, variant):
    path = gemma3_dir if variant == "tied" else hf_gemma3(tmp_path / variant,
                                                          **VARIANTS[variant])
    ours, ref = load_model(path, world1()), hf_oracle("Gemma3ForCausalLM", path)
    assert_prefill_matches(ours, ref, PROMPTS)
    assert_decode_matches(ours, ref, PROMPTS, STEPS)


def test_each_layer_reads_its_window_rope_and_scale(gemma3_dir):
    cfg = load_config(gemma3_dir)
    assert cfg.windows == (WINDOW, None, WINDOW, None)
    assert cfg.ropes == ((1e4, 1.0), (1e6, 1.0)) * 2
    assert cfg.tie_word_embeddings and cfg.query_pre_attn_scalar == 256.0


def test_legacy_fields_read_as_transformers_reads_them(tmp_path, gemma3_dir):
    """rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern instead of
    rope_parameters and layer_types: the layers' types and frequencies transformers builds."""
    import transformers
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    legacy = dict(rope_theta=5e5, rope_local_base_freq=5e3, sliding_window_pattern=2,
                  rope_scaling={"rope_type": "linear", "factor": 4.0})
    path = with_config(gemma3_dir, tmp_path / "legacy", drop=("rope_parameters", "layer_types"),
                 **legacy)
    raw = json.loads((path / "config.json").read_text())
    hf_cfg = transformers.Gemma3TextConfig(**{k: v for k, v in raw.items()
                                              if k not in ("model_type", "transformers_version")})
    rotary = Gemma3RotaryEmbedding(hf_cfg)
    cfg = load_config(path)
    for i, kind in enumerate(hf_cfg.layer_types):
        assert (cfg.windows[i] is None) == (kind == "full_attention")
        assert torch.equal(cfg.layer_frequencies(i), getattr(rotary, f"{kind}_inv_freq"))


@pytest.mark.parametrize("fields,message", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu' is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
     "rope_parameters.full_attention rope_type 'yarn' is not supported"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear"}}},
     "rope_parameters.sliding_attention.factor must be a positive number"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types must list num_hidden_layers=4"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a positive number"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config is not supported"),
])
def test_a_config_it_cannot_run_is_refused_by_name(tmp_path, gemma3_dir, fields, message):
    with pytest.raises(CheckpointError, match=message):
        load_config(with_config(gemma3_dir, tmp_path / "bad", **fields))
