"""DeepSeek-V4 at world 1 against transformers (fp32, eager): prefill logits at every position
and KV-cache decode logits against transformers' own cached decode, with prompts and
generations longer than the sliding window, hash-routed and top-k routed MoE layers, and the
mHC residual streams; the config and the topology checks."""

from __future__ import annotations

import pytest
import torch
from checkpoints.ds4 import TINY_DS4, hf_deepseek_v4, hf_deepseek_v4_reference
from oracle import TOL, assert_decode_matches, assert_prefill_matches, world1
from oracle import prefill as oracle_prefill

from layer_boundary.models import load_model
from layer_boundary.models.deepseek_v4 import DeepseekV4Config, check_parallel
from layer_boundary.models.kv_cache import KVCache
from layer_boundary.models.loader import CheckpointError
from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode
from layer_boundary.runtime.parallel import ParallelDims

# the third prompt is longer than the window (nearly three of the default one); the last
# grows past one while decoding
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 88, 2, 61, 33, 5, 9, 10, 11], [42]]
STEPS = 5

CASES = {
    "default": dict(),
    # tied embeddings, a clamp that bites (swiglu_limit 1), top-k routing first, 2 output
    # groups, 4 streams, a wider window, another rope base and routed scale
    "tied-clamped": dict(seed=1, tie=True, swiglu_limit=1.0, o_groups=2, hc_mult=4,
                         sliding_window=6, rope_theta=1e6, routed_scaling_factor=2.5,
                         mlp_layer_types=["moe", "hash_moe", "moe"]),
}


def prefill(model, prompts=PROMPTS):
    return oracle_prefill(model, prompts)


@pytest.mark.parametrize("case", list(CASES))
def test_world1_matches_transformers(tmp_path, case):
    path = hf_deepseek_v4(tmp_path / case, **CASES[case])
    ours = load_model(path, world1())
    ref = hf_deepseek_v4_reference(path)
    assert len(PROMPTS[2]) > ref.config.sliding_window

    assert_prefill_matches(ours, ref, PROMPTS)
    assert_decode_matches(ours, ref, PROMPTS, STEPS)


def test_window_sinks_clamp_and_hash_table_matter(tmp_path):
    """Each feature the oracle covers changes the logits when switched off, so a missing one
    could not pass above: a window as long as the prompt, no sinks, no clamp, another hash
    table."""
    path = hf_deepseek_v4(tmp_path / "ckpt", swiglu_limit=1.0)
    ours = load_model(path, world1())
    full = prefill(ours)

    def differs(change, undo):
        change()
        try:
            return (prefill(ours) - full).abs().max().item() > 1e-3
        finally:
            undo()

    def unwindowed(slots, max_len):
        return KVCache(TINY_DS4["num_hidden_layers"], slots, max_len, 1, TINY_DS4["head_dim"],
                       torch.float32, shared_kv=True)

    assert differs(lambda: setattr(ours, "make_kv_cache", unwindowed),
                   lambda: delattr(ours, "make_kv_cache"))
    attn = [layer.self_attn for layer in ours.model.layers]
    sinks = [a.sinks.data.clone() for a in attn]
    assert differs(lambda: [a.sinks.data.fill_(-1e4) for a in attn],
                   lambda: [a.sinks.data.copy_(s) for a, s in zip(attn, sinks)])
    experts = [layer.mlp.experts for layer in ours.model.layers]
    assert differs(lambda: [setattr(e, "limit", None) for e in experts],
                   lambda: [setattr(e, "limit", 1.0) for e in experts])
    table = ours.model.layers[0].mlp.gate.tid2eid
    saved = table.data.clone()
    assert differs(lambda: table.data.copy_(saved.roll(1, dims=0)),
                   lambda: table.data.copy_(saved))


def test_on_disk_names_are_the_original_ones(tmp_path):
    """save_pretrained writes DeepSeek's names; each maps onto one of our parameters."""
    from safetensors import safe_open

    path = hf_deepseek_v4(tmp_path / "ckpt")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for name in ("head.weight", "model.hc_head.hc_fn", "model.layers.0.attn.wq_a.weight",
                 "model.layers.0.attn.wkv.weight", "model.layers.0.attn.wo_a.weight",
                 "model.layers.0.attn.attn_sink", "model.layers.0.ffn.gate.tid2eid",
                 "model.layers.0.ffn.experts.0.w1.weight", "model.layers.0.hc_attn_fn",
                 "model.layers.1.ffn.gate.bias", "model.layers.0.attn_norm.weight"):
        assert name in names, name
    model = load_model(path, world1())
    params = dict(model.named_parameters())
    for name in names:
        mapped = model.checkpoint_name(name)
        assert mapped in params or ".experts." in mapped, (name, mapped)
    # the original checkpoints' top-level names map too
    assert model.checkpoint_name("embed.weight") == "model.embed_tokens.weight"
    assert model.checkpoint_name("hc_head_fn") == model.checkpoint_name("model.hc_head.hc_fn")
    assert model.checkpoint_name("norm.weight") in params
    assert model.checkpoint_name("layers.2.attn.wq_b.weight") == \
        "model.layers.2.self_attn.q_b_proj.weight"
    assert model.checkpoint_name("mtp.0.attn.wq_a.weight") is None


def test_hash_table_out_of_range_is_rejected(tmp_path):
    from layer_boundary.models.loader import iter_weights

    path = hf_deepseek_v4(tmp_path / "ckpt")
    model = load_model(path, world1())

    def weights():
        for name, t in iter_weights(path):
            yield name, (t + 8 if name.endswith("layers.2.ffn.gate.tid2eid") else t)

    with pytest.raises(CheckpointError, match=r"layers\.2\.ffn\.gate\.tid2eid"):
        model.load_weights(weights())


def base_config(**overrides) -> dict:
    cfg = dict(TINY_DS4, model_type="deepseek_v4", hidden_act="silu")
    cfg.update(overrides)
    return cfg


def test_config_fields():
    cfg = DeepseekV4Config.from_dict(base_config())
    assert (cfg.rope_head_dim, cfg.sliding_window, cfg.hc_mult, cfg.o_groups) == (8, 4, 3, 4)
    assert cfg.mlp_layer_types == ("hash_moe", "moe", "hash_moe")
    assert [cfg.is_hash(i) for i in range(3)] == [True, False, True]
    assert (cfg.swiglu_limit, cfg.scoring_func, cfg.softmax_scale) == (10.0, "sqrtsoftplus",
                                                                       16 ** -0.5)
    # legacy fields: compress_ratios (0: sliding), num_hash_layers, qk_rope_head_dim
    legacy = base_config(compress_ratios=[0, 0, 0, 0], num_hash_layers=1, qk_rope_head_dim=4)
    for name in ("layer_types", "mlp_layer_types", "partial_rotary_factor"):
        del legacy[name]
    cfg = DeepseekV4Config.from_dict(legacy)
    assert cfg.layer_types == ("sliding_attention",) * 3  # the MTP layer's entry dropped
    assert (cfg.mlp_layer_types, cfg.rope_head_dim) == (("hash_moe", "moe", "moe"), 4)
    # transformers' nested rope: the main (sliding) rope is read; yarn on compress is unused
    nested = base_config(rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 5e4, "partial_rotary_factor": 0.25},
        "compress": {"rope_type": "yarn", "rope_theta": 16e4, "factor": 16}})
    cfg = DeepseekV4Config.from_dict(nested)
    assert (cfg.rope_theta, cfg.rope_head_dim) == (5e4, 4)
    flat = DeepseekV4Config.from_dict(base_config(rope_parameters={"rope_type": "yarn",
                                                                   "factor": 16}))
    assert flat.rope_theta == 10000.0


@pytest.mark.parametrize("overrides,field", [
    (dict(layer_types=["sliding_attention", "compressed_sparse_attention",
                       "sliding_attention"]), "layer_types"),
    (dict(layer_types=["heavily_compressed_attention"] * 3), "layer_types"),
    (dict(layer_types=None), "layer_types"),
    (dict(layer_types=None, compress_ratios=[0, 128, 0]), "layer_types"),
    (dict(mlp_layer_types=["dense", "moe", "moe"]), "mlp_layer_types"),
    (dict(rope_parameters={"main": {"rope_type": "yarn", "factor": 4.0},
                           "compress": {"rope_type": "default"}}), "rope_parameters"),
    (dict(partial_rotary_factor=0.1), "partial_rotary_factor"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(n_shared_experts=2), "n_shared_experts"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(o_groups=3), "o_groups"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(swiglu_limit=-1), "swiglu_limit"),
])
def test_config_rejects_unsupported(overrides, field):
    with pytest.raises(CheckpointError, match=field):
        DeepseekV4Config.from_dict(base_config(**overrides))


@pytest.mark.parametrize("overrides,dims,field", [
    (dict(num_attention_heads=6, o_groups=2), ParallelDims(world_size=4, tp=4),
     "num_attention_heads"),
    (dict(o_groups=2), ParallelDims(world_size=4, tp=4), "o_groups"),
    (dict(n_routed_experts=6), ParallelDims(world_size=4, tp=4, moe_ep=4), "n_routed_experts"),
    (dict(moe_intermediate_size=30), ParallelDims(world_size=4, tp=4), "moe_intermediate_size"),
    (dict(moe_intermediate_size=30), ParallelDims(world_size=4, tp=4, attn_dp=4, moe_ep=2),
     "moe_intermediate_size"),
])
def test_check_parallel_names_the_field(overrides, dims, field):
    cfg = DeepseekV4Config.from_dict(base_config(**overrides))
    with pytest.raises(ValueError, match=field):
        check_parallel(cfg, dims)
    check_parallel(cfg, ParallelDims())  # world 1 always fits


@pytest.mark.parametrize("chunks", [(3, 5, 3), (1, 1, 9), (6, 5)])
def test_chunked_prefill_through_the_window_ring(tmp_path, chunks):
    """A prompt prefilled in chunks (cached prefix, several new tokens, some chunks longer
    than the window, so the ring wraps inside one write) gives the one-shot prefill's logits,
    which the oracle test checks against transformers."""
    path = hf_deepseek_v4(tmp_path / "ckpt")
    ours = load_model(path, world1())
    prompt = PROMPTS[2]
    assert sum(chunks) == len(prompt)
    full = prefill(ours, [prompt])
    cache = ours.make_kv_cache(1, len(prompt))
    assert cache.rows == TINY_DS4["sliding_window"]
    start = 0
    for n in chunks:
        batch = ForwardBatch.build(ForwardMode.EXTEND, [prompt[start:start + n]], [start],
                                   kv_cache=cache)
        with torch.no_grad():
            logits = ours(batch)
        diff = (logits - full[start:start + n]).abs().max().item()
        assert diff <= TOL, f"chunk at {start}: max abs diff {diff}"
        start += n
