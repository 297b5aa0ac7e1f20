"""GPT-OSS at world 1 against transformers (fp32, eager attention and experts): prefill
logits at every position and KV-cache decode steps within 1e-5, with the same greedy tokens,
for transformers' default config (YaRN rope, attention biases, sliding/full layers, the clamped
SwiGLU at alpha 1.702 and limit 7, an untied head), a default rope with a tied head, no
attention biases, other layer types and a tight clamp, and a truncated YaRN with an mscale
pair; the rotary frequencies and cos/sin scale are transformers' own to the bit. Plus what a
config.json it cannot run gets, and the topologies check_parallel refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from checkpoints import with_config
from checkpoints.gpt_oss import hf_gpt_oss, hf_gpt_oss_reference
from oracle import assert_decode_matches, assert_prefill_matches, world1

from layer_boundary.models import load_config, load_model
from layer_boundary.models.config import CheckpointError
from layer_boundary.models.gpt_oss import check_parallel
from layer_boundary.runtime.parallel import ParallelDims

# window 3 (2 in the second variant): every prompt but the second outgrows it
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [50, 3, 17, 88, 2, 61, 33]]
STEPS = 3

VARIANTS = {
    "defaults-yarn": {},
    "default-rope-tied-no-bias-clamped": dict(
        seed=1, tie=True, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        attention_bias=False, swiglu_limit=0.5, swiglu_alpha=1.3, sliding_window=2,
        layer_types=["full_attention", "sliding_attention", "sliding_attention",
                     "full_attention"]),
    "yarn-truncated-mscale": dict(
        seed=2, max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 8.0,
                         "beta_slow": 2.0, "truncate": True, "mscale": 1.0,
                         "mscale_all_dim": 0.5}),
}


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory):
    return hf_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "defaults")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_world1_matches_transformers_prefill_and_decode(default_dir, tmp_path, variant):
    kwargs = VARIANTS[variant]
    path = hf_gpt_oss(tmp_path / variant, **kwargs) if kwargs else default_dir
    ours, ref = load_model(path, world1()), hf_gpt_oss_reference(path)
    attn, rotary = ours.model.layers[0].self_attn, ref.model.rotary_emb
    assert torch.equal(attn.inv_freq, rotary.inv_freq)
    assert attn.rope_scale == rotary.attention_scaling
    assert_prefill_matches(ours, ref, PROMPTS)
    assert_decode_matches(ours, ref, PROMPTS, STEPS)


def test_the_sinks_and_the_window_change_what_it_computes(default_dir, tmp_path):
    """Zero sinks and no window give other logits (so the oracle runs check both)."""
    from safetensors.torch import load_file, save_file

    base = load_model(default_dir, world1())
    for change in ("sinks", "window"):
        other = tmp_path / change
        shutil.copytree(default_dir, other)
        if change == "sinks":
            tensors = load_file(other / "model.safetensors")
            tensors = {k: torch.zeros_like(v) if k.endswith("sinks") else v
                       for k, v in tensors.items()}
            save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
        else:
            cfg = json.loads((other / "config.json").read_text())
            (other / "config.json").write_text(json.dumps(dict(cfg, sliding_window=64)))
        a = assert_differs(base, load_model(other, world1()))
        assert a > 1e-3, change


def assert_differs(a, b) -> float:
    from oracle import prefill

    return (prefill(a, [PROMPTS[2]]) - prefill(b, [PROMPTS[2]])).abs().max().item()


@pytest.mark.parametrize("fields,message", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     "rope_type 'longrope' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
     "rope_parameters has no factor"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config is not supported"),
    ({"layer_types": ["chunked_attention"] * 4}, "chunked_attention.*not supported"),
    ({"sliding_window": None}, "no sliding_window"),
    ({"swiglu_limit": "7"}, "swiglu_limit must be a positive number"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds the 8 experts"),
])
def test_a_config_it_cannot_run_is_refused_by_name(default_dir, tmp_path, fields, message):
    with pytest.raises(CheckpointError, match=message):
        load_config(with_config(default_dir, tmp_path / "bad", **fields))


def test_transformers_defaults_fill_what_config_json_leaves_out(default_dir, tmp_path):
    """No rope_parameters, layer_types, sliding_window or swiglu fields: GptOssConfig's
    defaults (YaRN factor 32 over 4096 positions at theta 150000, even layers sliding over
    128 positions, alpha 1.702, limit 7)."""
    cfg = json.loads((default_dir / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "sliding_window", "swiglu_alpha",
                "swiglu_limit", "attention_bias"):
        cfg.pop(key)
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text(json.dumps(cfg))
    ours, full = load_config(tmp_path / "bare"), load_config(default_dir)
    assert ours.windows == (128, None, 128, None) and full.windows == (3, None, 3, None)
    assert ours.rope == full.rope and ours.rope_theta == full.rope_theta == 150000.0
    assert (ours.swiglu_alpha, ours.swiglu_limit, ours.attention_bias) == (1.702, 7.0, True)


@pytest.mark.parametrize("dims,field", [
    (ParallelDims(world_size=4, tp=4, moe_ep=4), None),
    (ParallelDims(world_size=8, tp=8, moe_ep=8), None),
    (ParallelDims(world_size=16, tp=16, attn_dp=2, moe_ep=16), "num_local_experts=8"),
    (ParallelDims(world_size=64, tp=64, attn_dp=8, moe_ep=1), "intermediate_size=32"),
    (ParallelDims(world_size=16, tp=16, moe_ep=8), "num_attention_heads=8"),
])
def test_check_parallel_names_the_field(default_dir, dims, field):
    cfg = load_config(default_dir)
    if field is None:
        check_parallel(cfg, dims)
        return
    with pytest.raises(ValueError, match=field):
        check_parallel(cfg, dims)
