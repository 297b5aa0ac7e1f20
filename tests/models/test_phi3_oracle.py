"""Phi-3 (``models/phi3.py``: fused qkv_proj and gate_up_proj, partial rotary, a sliding
window) at world 1 against transformers (fp32, eager attention): prefill logits at every
position and KV-cache decode steps within 1e-5, a window shorter than the prompts and their
decode steps; the rope read as Phi-3's config reads it; refusals named."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import hf_oracle, with_config
from checkpoints.phi3 import WINDOW, hf_phi3
from oracle import assert_decode_matches, assert_prefill_matches, world1

from layer_boundary.models import load_config, load_model
from layer_boundary.models.config import CheckpointError

PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [50, 3, 17, 33, 2, 61, 33, 5]]
STEPS = 4

VARIANTS = {
    "gqa-window-partial": {},
    # a tied head, MHA, no window, 3/4 of each head rotating, another theta
    "tied-mha-nowindow": dict(seed=1, tie_word_embeddings=True, num_key_value_heads=4,
                              sliding_window=None, partial_rotary_factor=0.75,
                              rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return hf_phi3(tmp_path_factory.mktemp("phi3") / "phi3")


@pytest.mark.parametrize("variant", VARIANTS)
def test_world1_matches_transformers(tmp_path, phi3_dir, variant):
    path = phi3_dir if not VARIANTS[variant] else hf_phi3(tmp_path / variant,
                                                          **VARIANTS[variant])
    ours, ref = load_model(path, world1()), hf_oracle("Phi3ForCausalLM", path)
    assert_prefill_matches(ours, ref, PROMPTS)
    assert_decode_matches(ours, ref, PROMPTS, STEPS)


def test_the_rope_reads_as_phi3_config_reads_it(tmp_path, phi3_dir):
    """A legacy ``rope_scaling`` dict wins over ``rope_parameters``, a top-level
    ``partial_rotary_factor`` fills in: the frequencies and width transformers builds."""
    import transformers
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    path = with_config(phi3_dir, tmp_path / "legacy", partial_rotary_factor=0.75,
                       rope_scaling={"type": "default", "rope_theta": 300.0},
                       rope_parameters={"rope_type": "default", "rope_theta": 9.0})
    raw = json.loads((path / "config.json").read_text())
    hf_cfg = transformers.Phi3Config(**{k: v for k, v in raw.items()
                                        if k not in ("model_type", "transformers_version")})
    inv_freq = Phi3RotaryEmbedding(hf_cfg).inv_freq
    cfg = load_config(path)
    assert (cfg.rope_theta, cfg.rotary_dim, cfg.sliding_window) == (300.0, 6, WINDOW)
    model = load_model(path, world1())
    assert torch.equal(model.model.layers[0].self_attn.inv_freq, inv_freq)


LONGROPE = {"type": "longrope", "short_factor": [1.0] * 2, "long_factor": [2.0] * 2}


@pytest.mark.parametrize("fields,message", [
    ({"rope_scaling": LONGROPE}, "rope_type 'longrope' is not supported"),
    ({"rope_scaling": {"type": "su"}}, "rope_type 'su' is not supported"),
    ({"partial_rotary_factor": 0.1, "rope_parameters": {"rope_theta": 1e4}},
     r"partial_rotary_factor=0.1 rotates 0 of head_dim=8 dims"),
    ({"partial_rotary_factor": 1.5, "rope_parameters": {"rope_theta": 1e4}},
     r"partial_rotary_factor must be a number in \(0, 1\], got 1.5"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"hidden_act": "gelu_new"}, "hidden_act 'gelu_new' is not supported"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config is not supported"),
])
def test_a_config_it_cannot_run_is_refused_by_name(tmp_path, phi3_dir, fields, message):
    with pytest.raises(CheckpointError, match=message):
        load_config(with_config(phi3_dir, tmp_path / "bad", **fields))


def test_a_fused_tensor_of_another_shape_is_refused_naming_it(tmp_path, phi3_dir):
    """qkv_proj written for 2 kv heads, read with a config of 4: the tensor named."""
    path = with_config(phi3_dir, tmp_path / "mha", num_key_value_heads=4)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    with pytest.raises(CheckpointError, match=rf"checkpoint tensor {name} has shape \(64, 32\); "
                                              r"the fused layout \(blocks 32 q \+ 32 k \+ 32 v\) "
                                              r"is \(96, 32\)"):
        load_model(path, world1())
