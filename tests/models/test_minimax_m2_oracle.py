"""MiniMax-M2 (``models/minimax_m2.py``) at world 1 against transformers (fp32, eager
attention and experts): prefill logits and KV-cache decode steps within 1e-5 and the same
greedy tokens, with half of each head rotating (``rotary_dim``) and with the config's default
(the whole head) and a tied head; the selection bias changes what it computes (so the runs
check it); the rotary dims read as transformers reads them; fields it cannot run and
topologies it cannot shard are refused by name."""

from __future__ import annotations

import json

import pytest
import transformers
from checkpoints.mixtral import (ROTARY_DIM, TINY_MIXTRAL, hf_minimax_m2,
                                 hf_minimax_m2_reference)
from test_llama_oracle import assert_matches, world1

from layer_boundary.engine.generate import greedy_generate
from layer_boundary.models import load_config, load_model, model_class
from layer_boundary.models.config import CheckpointError
from layer_boundary.runtime.parallel import ParallelDims

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 58, 2, 61, 33]]
STEPS = 4

VARIANTS = {
    "partial-rotary": {},
    "default-tied": dict(seed=1, rotary_dim=None, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    return hf_minimax_m2(tmp_path_factory.mktemp("minimax_m2") / "partial")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_world1_matches_transformers_prefill_and_decode(tmp_path, partial, variant):
    path = partial if not VARIANTS[variant] else hf_minimax_m2(tmp_path / variant,
                                                               **VARIANTS[variant])
    assert_matches(path, hf_minimax_m2_reference, PROMPTS, STEPS)


def test_the_selection_bias_changes_the_experts_chosen(partial):
    """Without the checkpoint's e_score_correction_bias the same weights choose other experts
    somewhere in the prompts (the bias, random in the checkpoint, is what the oracle checks)."""
    model = load_model(partial, world1())
    with_bias = greedy_generate(model, PROMPTS, 1).logits
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            assert p.abs().max() > 0, name
            p.data.zero_()
    without = greedy_generate(model, PROMPTS, 1).logits
    assert max((a[0] - b[0]).abs().max().item() for a, b in zip(with_bias, without)) > 1e-3


def _config(tmp_path, **fields):
    transformers.MiniMaxM2Config(**{**TINY_MIXTRAL, **fields}).save_pretrained(tmp_path)
    return tmp_path


def _edited(tmp_path, **fields):
    path = _config(tmp_path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **fields}))
    return path


@pytest.mark.parametrize("fields,rotary", [
    ({}, 8),  # the config's default: the whole head
    (dict(rotary_dim=ROTARY_DIM), ROTARY_DIM),  # rotary_dim: a factor of rotary_dim / head_dim
    (dict(partial_rotary_factor=0.25), 2),
])
def test_the_rotary_dims_read_as_transformers_reads_them(tmp_path, fields, rotary):
    path = _config(tmp_path, **fields)
    cfg = load_config(path)
    assert cfg.rotary_dim == rotary and cfg.num_experts == 4 and cfg.rope_theta == 5e6
    hf = transformers.AutoConfig.from_pretrained(path)
    theirs = transformers.MiniMaxM2ForCausalLM(hf).model.rotary_emb.inv_freq
    assert theirs.shape[0] * 2 == rotary


def test_the_rope_dicts_factor_wins_over_rotary_dim(tmp_path):
    path = _edited(tmp_path, rotary_dim=2, rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    cfg = load_config(path)
    assert (cfg.rotary_dim, cfg.rope_theta) == (4, 1e4)


@pytest.mark.parametrize("fields,message", [
    ({"use_qk_norm": False}, "use_qk_norm=False is not supported"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
    ({"shared_intermediate_size": 16}, "shared_intermediate_size=16 is not supported"),
    ({"rotary_dim": 3}, "gives 3 rotary dims of head_dim=8"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_type 'yarn' is not supported"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds the 4 experts"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config is not supported"),
])
def test_a_config_it_cannot_run_is_refused_by_name(tmp_path, fields, message):
    with pytest.raises(CheckpointError, match=message):
        load_config(_edited(tmp_path, **fields))


def test_a_topology_it_cannot_shard_is_refused_by_name(tmp_path):
    cfg = load_config(_config(tmp_path))
    with pytest.raises(ValueError, match="num_local_experts=4 is not divisible by ep=8"):
        model_class("minimax_m2").check_parallel(
            cfg, ParallelDims(world_size=8, tp=8, attn_dp=2, moe_ep=8))
