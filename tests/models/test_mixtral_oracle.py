"""Mixtral (``models/mixtral.py``) at world 1 against transformers (fp32, eager attention and
experts): prefill logits and KV-cache decode steps within 1e-5 and the same greedy tokens,
with a sliding window shorter than the prompts (on the positional cache) and with the
config's default (no window) and a tied head; the window changes what it computes; config
fields it cannot run and topologies it cannot shard are refused by name."""

from __future__ import annotations

import json

import pytest
import transformers
from checkpoints.mixtral import TINY_MIXTRAL, WINDOW, hf_mixtral, hf_mixtral_reference
from test_llama_oracle import assert_matches, world1

from layer_boundary.engine.generate import greedy_generate
from layer_boundary.models import load_config, load_model, model_class
from layer_boundary.models.config import CheckpointError
from layer_boundary.runtime.parallel import ParallelDims

# the longest is 7 tokens: with 4 decode steps its last queries are 10 positions past the
# first key, beyond the window of 4
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 58, 2, 61, 33]]
STEPS = 4

VARIANTS = {
    "window": {},
    "default-tied": dict(seed=1, sliding_window=None, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    return hf_mixtral(tmp_path_factory.mktemp("mixtral") / "window")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_world1_matches_transformers_prefill_and_decode(tmp_path, windowed, variant):
    path = windowed if not VARIANTS[variant] else hf_mixtral(tmp_path / variant,
                                                             **VARIANTS[variant])
    assert_matches(path, hf_mixtral_reference, PROMPTS, STEPS)


def test_the_window_changes_what_it_computes(tmp_path, windowed):
    """The same weights without the window differ once a prompt outgrows it (so the windowed
    oracle run checks the window, not full attention)."""
    full = tmp_path / "full"
    full.mkdir()
    for f in windowed.iterdir():
        (full / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((full / "config.json").read_text())
    (full / "config.json").write_text(json.dumps(dict(cfg, sliding_window=None)))
    prompt = [PROMPTS[2]]
    a = greedy_generate(load_model(windowed, world1()), prompt, 1).logits[0][0]
    b = greedy_generate(load_model(full, world1()), prompt, 1).logits[0][0]
    assert len(prompt[0]) > WINDOW and (a - b).abs().max() > 1e-3


def _config(tmp_path, **fields):
    transformers.MixtralConfig(**{**TINY_MIXTRAL, **fields}).save_pretrained(tmp_path)
    return tmp_path


def test_config_defaults_and_layout(tmp_path):
    cfg = load_config(_config(tmp_path))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    assert cfg.sliding_window is None and cfg.rope_theta == 1e6 and cfg.norm_topk_prob
    assert model_class("mixtral").positional_cache  # the window is a mask, not a ring


@pytest.mark.parametrize("fields,message", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_type 'yarn' is not supported"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds the 4 experts"),
    ({"num_local_experts": "4"}, "num_local_experts must be a positive integer"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config is not supported"),
])
def test_a_config_it_cannot_run_is_refused_by_name(tmp_path, fields, message):
    path = _config(tmp_path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **fields}))
    with pytest.raises(CheckpointError, match=message):
        load_config(path)


@pytest.mark.parametrize("dims,fields,message", [
    (ParallelDims(world_size=8, tp=8, attn_dp=2, moe_ep=8), {},
     "num_local_experts=4 is not divisible by ep=8"),
    (ParallelDims(world_size=8, tp=8, attn_dp=8), dict(intermediate_size=36),
     "intermediate_size=36 is not divisible by the MoE tensor-parallel size tp/ep=8"),
    (ParallelDims(world_size=8, tp=8), {}, "num_attention_heads=4 is not divisible by "
     "attention tp=8"),
])
def test_a_topology_it_cannot_shard_is_refused_by_name(tmp_path, dims, fields, message):
    cfg = load_config(_config(tmp_path, **fields))
    with pytest.raises(ValueError, match=message):
        model_class("mixtral").check_parallel(cfg, dims)
