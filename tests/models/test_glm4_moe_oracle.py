"""GLM-4.5 (glm4_moe) at world 1 against transformers (fp32, eager): prefill logits and
KV-cache decode steps within 1e-5, with q/k norms and q/k/v biases (o_proj unbiased), the
default partial rotary (half of each head) and another factor, grouped sigmoid routing with
e_score_correction_bias, tied and untied heads; plus the config fields refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
from checkpoints.glm4_moe import hf_glm4_moe, hf_glm4_moe_reference
from test_llama_oracle import assert_matches

from layer_boundary.models import load_config
from layer_boundary.models.config import CheckpointError

VARIANTS = {
    # q/k norms, q/k/v biases, partial rotary 0.5, 2 groups of 4 (top 1 group), untied
    "qknorm-bias-grouped": dict(),
    # no q/k norm or biases, heads of 32 (head_dim set, wider than hidden / heads, as
    # GLM-4.5's), a quarter of each head rotates, ungrouped, unnormalized top-k weights,
    # tied, every layer MoE
    "plain-quarter-rope-tied": dict(seed=1, use_qk_norm=False, attention_bias=False, head_dim=32,
                                    partial_rotary_factor=0.25, n_group=1, topk_group=1,
                                    norm_topk_prob=False, tie=True, first_k_dense_replace=0,
                                    routed_scaling_factor=1.0, rope_theta=1e6),
}


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return hf_glm4_moe(tmp_path_factory.mktemp("glm4_moe"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_world1_matches_transformers_prefill_and_decode(tmp_path, glm_dir, variant):
    kwargs = VARIANTS[variant]
    path = glm_dir if not kwargs else hf_glm4_moe(tmp_path / variant, **kwargs)
    assert_matches(path, hf_glm4_moe_reference)


def test_config_reads_partial_rotary(glm_dir):
    cfg = load_config(glm_dir)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.num_key_value_heads) == (16, 8, 2)
    assert cfg.use_qk_norm and cfg.attention_bias and cfg.num_nextn_predict_layers == 1


@pytest.mark.parametrize("field,value,message", [
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
     "rope_type 'yarn' is not supported"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
    ("n_group", 3, "n_routed_experts=8 is not divisible by n_group=3"),
    ("use_qk_norm", "yes", "field use_qk_norm must be true or false"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config is not supported"),
])
def test_unsupported_fields_are_refused_by_name(tmp_path, glm_dir, field, value, message):
    path = tmp_path / "glm"
    shutil.copytree(glm_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(CheckpointError, match=message):
        load_config(path)
