"""Cohere and Cohere2 (``models/cohere.py``, ``cohere2.py``: parallel blocks, LayerNorms
without bias, interleaved rotary, a scaled tied head; Cohere2's sliding layers roped and full
ones unroped) at world 1 against transformers (fp32, eager attention): prefill logits at
every position and KV-cache decode steps within 1e-5; refusals named."""

from __future__ import annotations

import pytest
from checkpoints import hf_oracle, with_config
from checkpoints.cohere import hf_cohere, hf_cohere2
from oracle import assert_decode_matches, assert_prefill_matches, world1

from layer_boundary.models import load_config, load_model
from layer_boundary.models.config import CheckpointError

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 33, 2, 61, 33]]
STEPS = 4

VARIANTS = {
    "cohere": (hf_cohere, "CohereForCausalLM", {}),
    # an untied head, attention biases, MHA
    "cohere-untied-bias": (hf_cohere, "CohereForCausalLM",
                           dict(seed=1, tie_word_embeddings=False, attention_bias=True,
                                num_key_value_heads=4)),
    "cohere2": (hf_cohere2, "Cohere2ForCausalLM", {}),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_world1_matches_transformers(tmp_path, variant):
    write, cls, fields = VARIANTS[variant]
    path = write(tmp_path / variant, **fields)
    ours, ref = load_model(path, world1()), hf_oracle(cls, path)
    assert_prefill_matches(ours, ref, PROMPTS)
    assert_decode_matches(ours, ref, PROMPTS, STEPS)


def test_cohere2_ropes_only_its_sliding_layers(tmp_path):
    cfg = load_config(hf_cohere2(tmp_path / "c2"))
    assert cfg.windows == (3, None, 3, None)
    assert [cfg.layer_rope(i) for i in range(4)] == [True, False, True, False]
    cfg = load_config(with_config(tmp_path / "c2", tmp_path / "p", drop=("layer_types",),
                                  sliding_window_pattern=2))
    assert cfg.windows == (3, None, 3, None)


@pytest.mark.parametrize("fields,message", [
    ({"use_qk_norm": True}, "use_qk_norm=true is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type 'yarn'"),
    ({"logit_scale": -1}, "logit_scale must be a positive number"),
])
def test_a_config_it_cannot_run_is_refused_by_name(tmp_path, fields, message):
    path = hf_cohere(tmp_path / "c")
    with pytest.raises(CheckpointError, match=message):
        load_config(with_config(path, tmp_path / "bad", **fields))


@pytest.mark.parametrize("write,cls", [(hf_cohere, "CohereForCausalLM"),
                                       (hf_cohere2, "Cohere2ForCausalLM")])
def test_a_head_dim_beside_hidden_over_heads_is_read_as_transformers(tmp_path, write, cls):
    # transformers sets config.json's head_dim (16) over hidden_size // heads (8), Cohere2's too
    path = write(tmp_path / "c", head_dim=16)
    assert load_config(path).head_dim == 16
    assert_prefill_matches(load_model(path, world1()), hf_oracle(cls, path), [[1, 2, 3]])


@pytest.mark.parametrize("write", [hf_cohere, hf_cohere2], ids=["cohere", "cohere2"])
def test_a_null_head_dim_is_refused_by_name(tmp_path, write):
    """transformers keeps a null head_dim as None (and fails on it); Cohere derived one."""
    path = with_config(write(tmp_path / "c"), tmp_path / "null", head_dim=None)
    with pytest.raises(CheckpointError, match="config.json field head_dim is null"):
        load_config(path)
