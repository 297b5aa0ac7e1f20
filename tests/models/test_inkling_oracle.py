"""Inkling's text model (``models/inkling.py``: short convolutions as residual updates and on
k/v, relative-bias attention on sliding and full layers, dense and MoE layers with shared
experts) at world 1 against transformers (fp32, eager): prefill logits at every position and
KV-cache decode steps within 1e-5, a window and a relative extent shorter than the prompts;
a second config with log-scaled full layers, one kv head, a 3-tap kernel and every layer a
MoE. Refusals named: config fields it does not compute, and a runtime whose residual would
leave the token rows its convolutions need."""

from __future__ import annotations

import re

import pytest
from checkpoints import hf_oracle, with_config
from checkpoints.inkling import hf_inkling
from oracle import assert_decode_matches, assert_prefill_matches, world1

from layer_boundary.models import load_config, load_model
from layer_boundary.models.config import CheckpointError

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [7, 8, 9], [50, 3, 17, 33, 2, 61, 33, 12, 5]]
STEPS = 4

VARIANTS = {
    "window-dense-moe": {},
    "log-scaling-mqa-k3-all-moe": dict(
        seed=1, log_scaling_n_floor=2, log_scaling_alpha=0.5, num_key_value_heads=1,
        swa_num_key_value_heads=1, head_dim=16, conv_kernel_size=3, local_layer_ids=[1, 2],
        mlp_layer_types=["sparse"] * 4),
}


@pytest.fixture(scope="module")
def inkling_dir(tmp_path_factory):
    return hf_inkling(tmp_path_factory.mktemp("inkling") / "inkling")


@pytest.mark.parametrize("variant", VARIANTS)
def test_world1_matches_transformers(tmp_path, inkling_dir, variant):
    path = inkling_dir if not VARIANTS[variant] else hf_inkling(tmp_path / variant,
                                                                **VARIANTS[variant])
    ours, ref = load_model(path, world1()), hf_oracle("InklingForCausalLM", path)
    assert_prefill_matches(ours, ref, PROMPTS)
    assert_decode_matches(ours, ref, PROMPTS, STEPS)


def test_the_config_reads_each_layers_kind(inkling_dir):
    cfg = load_config(inkling_dir)
    assert cfg.sliding == (True, False, True, False)
    assert cfg.sparse == (False, True, False, True)
    assert cfg.full_heads == (4, 2, 8) and cfg.sliding_heads == (4, 4, 8)
    assert (cfg.sliding_window_size, cfg.rel_extent, cfg.conv_kernel_size) == (3, 5, 4)


@pytest.mark.parametrize("fields,message", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"unpadded_vocab_size": 60}, "unpadded_vocab_size=60 below vocab_size=64"),
    ({"shared_expert_sink": False}, "shared_expert_sink=false is not supported"),
    ({"layer_types": ["hybrid"] * 3}, "layer_types must list num_hidden_layers=4"),
    ({"mlp_layer_types": ["moe"] * 4}, "mlp_layer_types must list"),
    ({"d_rel": "4"}, "field d_rel must be a positive integer"),
    # the alias sets the expert count (ALIASES), so the top-k is checked against it
    ({"num_local_experts": 1}, "num_experts_per_tok=2 exceeds the 1 experts"),
])
def test_a_config_it_cannot_run_is_refused_by_name(tmp_path, inkling_dir, fields, message):
    with pytest.raises(CheckpointError, match=message):
        load_config(with_config(inkling_dir, tmp_path / "bad", **fields))


def test_an_alias_beside_its_field_wins_as_in_transformers(tmp_path, inkling_dir):
    # transformers' attribute_map: embedding_multiplier sets logits_mup_width_multiplier
    path = with_config(inkling_dir, tmp_path / "alias", embedding_multiplier=5.0)
    assert load_config(path).logits_mup_width_multiplier == 5.0
    assert_prefill_matches(load_model(path, world1()), hf_oracle("InklingForCausalLM", path),
                           [[1, 2, 3]])


@pytest.mark.parametrize("fields,message", [
    # the alias's value sizes the weights, which then do not fit (transformers refuses them too)
    ({"sliding_window": 4}, "rel_logits_proj.proj (shape (4, 3)) does not fit"),
    ({"sconv_kernel_size": 3}, "attn_sconv.conv1d.weight (shape (32, 1, 4)) does not fit"),
    ({"num_local_experts": 4}, "experts.down_proj (shape (8, 32, 16)) does not fit"),
])
def test_an_alias_sizing_the_weights_wins_and_they_are_refused(tmp_path, inkling_dir, fields,
                                                               message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_model(with_config(inkling_dir, tmp_path / "alias", **fields), world1())


@pytest.mark.parametrize("field", ["embedding_multiplier", "logits_mup_width_multiplier",
                                   "sliding_window", "num_local_experts"])
def test_a_null_alias_or_aliased_field_is_refused_by_name(tmp_path, inkling_dir, field):
    with pytest.raises(CheckpointError, match=f"config.json field {field} is null"):
        load_config(with_config(inkling_dir, tmp_path / "null", **{field: None}))


def test_a_topology_the_sliding_heads_do_not_split_over_names_their_field(tmp_path,
                                                                          inkling_dir):
    """The sliding layers' heads were reported as num_attention_heads."""
    from layer_boundary.models.inkling import check_parallel
    from layer_boundary.runtime import ParallelDims

    cfg = load_config(with_config(inkling_dir, tmp_path / "swa", swa_num_attention_heads=3,
                                  swa_num_key_value_heads=1))
    with pytest.raises(ValueError, match=r"^swa_num_attention_heads=3 is not divisible by "
                                         r"attention tp=2$"):
        check_parallel(cfg, ParallelDims(world_size=2, tp=2))
