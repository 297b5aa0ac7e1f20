"""DeepSeek-V2 at world 1 against transformers (fp32, eager): prefill logits and KV-cache
decode steps within 1e-5, without q LoRA (V2-Lite's q_proj) and with it (the config class's
default), under group_limited_greedy and greedy routing, tied and untied heads, attention
biases and a routed scale; plus the config fields refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
from checkpoints.deepseek_v2 import hf_deepseek_v2, hf_deepseek_v2_reference
from test_llama_oracle import assert_matches

from layer_boundary.models import load_config
from layer_boundary.models.config import CheckpointError

VARIANTS = {
    # no q LoRA, group-limited greedy routing, untied
    "noqlora-grouped": dict(),
    # q LoRA (transformers' default), greedy routing, tied, attention biases, routed scale 2
    "qlora-greedy-tied-bias": dict(seed=1, q_lora_rank=16, topk_method="greedy", n_group=None,
                                   topk_group=None, tie=True, attention_bias=True,
                                   routed_scaling_factor=2.0, rope_theta=1e6),
    # every layer MoE, groups of one expert (a group's best is the expert itself)
    "all-moe-groups-of-one": dict(seed=2, first_k_dense_replace=0, n_group=8, topk_group=4),
}


@pytest.fixture(scope="module")
def ds2_dir(tmp_path_factory):
    return hf_deepseek_v2(tmp_path_factory.mktemp("deepseek_v2"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_world1_matches_transformers_prefill_and_decode(tmp_path, ds2_dir, variant):
    kwargs = VARIANTS[variant]
    path = ds2_dir if not kwargs else hf_deepseek_v2(tmp_path / variant, **kwargs)
    assert_matches(path, hf_deepseek_v2_reference)


def test_config_reads_v2_routing(ds2_dir):
    cfg = load_config(ds2_dir)
    assert (cfg.model_type, cfg.topk_method, cfg.n_group, cfg.topk_group) == (
        "deepseek_v2", "group_limited_greedy", 4, 2)
    assert cfg.q_lora_rank is None and not cfg.norm_topk_prob and cfg.rope_interleave


@pytest.mark.parametrize("field,value,message", [
    ("topk_method", "noaux_tc", "topk_method 'noaux_tc' is not supported"),
    ("norm_topk_prob", True, "norm_topk_prob=true is not supported"),
    ("scoring_func", "sigmoid", "scoring_func 'sigmoid' is not supported"),
    ("mlp_bias", True, "mlp_bias=true is not supported"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0},
     "rope_parameters.rope_type 'yarn' is not supported"),
    ("n_group", 3, "n_routed_experts=8 is not divisible by n_group=3"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config is not supported"),
])
def test_unsupported_fields_are_refused_by_name(tmp_path, ds2_dir, field, value, message):
    path = tmp_path / "ds2"
    shutil.copytree(ds2_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(CheckpointError, match=message):
        load_config(path)
