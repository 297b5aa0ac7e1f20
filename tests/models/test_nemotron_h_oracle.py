"""Nemotron-H at world 1 against transformers (fp32, eager attention, eager experts, the
pure-torch Mamba2 path): prefill logits at every position, SSM/KV-cache decode logits against
transformers' own cached decode, a prefill continued from a cached prefix, and the config."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints.nh import TINY_NH, hf_nemotron_h, hf_nemotron_h_reference
from oracle import TOL, hf_cached_decode, world1

from distributed.checks import cli_ok
from layer_boundary.models import load_model
from layer_boundary.engine.generate import greedy_generate
from layer_boundary.models.loader import CheckpointError
from layer_boundary.models.nemotron_h import NemotronHConfig, check_parallel
from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode
from layer_boundary.runtime.parallel import ParallelDims

# lengths 5, 3, 11 and 1: two, one and three chunks of 4, prompts shorter than the conv window
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 88, 2, 61, 33, 5, 9, 10, 11], [42]]
STEPS = 5

CASES = {
    # TINY_NH: every block kind, mixer->mixer and ffn->ffn, terminal MoE
    "default": dict(),
    # starts with attention, ends with a Mamba mixer; one B/C group; biases everywhere; tied;
    # unnormalised top-k; a chunk of 3; time steps often below time_step_min, so prefill
    # clamps them (decode does not, as transformers)
    "tied-bias-clamp": dict(
        seed=1, tie=True, layers_block_type=["full_attention", "moe", "linear_attention",
                                             "full_attention", "mlp", "linear_attention"],
        n_groups=1, use_bias=True, mlp_bias=True, norm_topk_prob=False,
        routed_scaling_factor=1.0, chunk_size=3, time_step_min=0.05),
    # one B/C group per head, a smaller state, no conv bias, a 2-tap conv, ungrouped routing
    "groups8-noconvbias": dict(seed=2, n_groups=8, use_conv_bias=False, ssm_state_size=8,
                               n_group=1, topk_group=1, conv_kernel=2),
}


def hf_full(ref, seq):
    with torch.no_grad():
        return ref(torch.tensor([seq])).logits[0]


def forward(ours, mode, requests, prefix, cache):
    batch = ForwardBatch.build(mode, requests, prefix, kv_cache=cache)
    with torch.no_grad():
        return ours(batch)


@pytest.mark.parametrize("case", list(CASES))
def test_world1_matches_transformers(tmp_path, case):
    path = hf_nemotron_h(tmp_path / case, **CASES[case])
    ours = load_model(path, world1())
    ref = hf_nemotron_h_reference(path)

    # prefill: every position of every request, the requests in one batch
    logits = forward(ours, ForwardMode.EXTEND, PROMPTS, [0] * len(PROMPTS),
                     ours.make_kv_cache(len(PROMPTS), max(map(len, PROMPTS))))
    start = 0
    for j, prompt in enumerate(PROMPTS):
        diff = (logits[start:start + len(prompt)] - hf_full(ref, prompt)).abs().max().item()
        assert diff <= TOL, f"prompt {j} prefill: max abs diff {diff}"
        start += len(prompt)

    # decode: our SSM/KV-cache steps against transformers' cached decode of the same tokens
    gen = greedy_generate(ours, PROMPTS, STEPS)
    for j, prompt in enumerate(PROMPTS):
        expected = hf_cached_decode(ref, prompt, gen.generated[j][:-1])
        for step in range(STEPS):
            diff = (expected[step] - gen.logits[j][step]).abs().max().item()
            assert diff <= TOL, f"prompt {j} step {step}: max abs diff {diff}"
        assert gen.generated[j] == expected.argmax(-1).tolist()


def test_prefill_continues_from_a_cached_prefix(tmp_path):
    """A prefill in two parts (the second with a cached prefix: conv window and SSM state
    carried over, the chunked scan started from the state) equals one prefill."""
    path = hf_nemotron_h(tmp_path / "ckpt")
    ours = load_model(path, world1())
    ref = hf_nemotron_h_reference(path)
    prompts = PROMPTS[:3]
    cuts = [2, 1, 6]  # inside the first chunk, before the conv window fills, mid-chunk
    cache = ours.make_kv_cache(len(prompts), max(map(len, prompts)))
    forward(ours, ForwardMode.EXTEND, [p[:c] for p, c in zip(prompts, cuts)], [0] * 3, cache)
    logits = forward(ours, ForwardMode.EXTEND, [p[c:] for p, c in zip(prompts, cuts)], cuts,
                     cache)
    start = 0
    for j, (prompt, cut) in enumerate(zip(prompts, cuts)):
        n = len(prompt) - cut
        diff = (logits[start:start + n] - hf_full(ref, prompt)[cut:]).abs().max().item()
        assert diff <= TOL, f"prompt {j}: max abs diff {diff}"
        start += n


def test_lm_head_is_never_tied_but_falls_back_to_the_embedding(tmp_path):
    """transformers' Nemotron-H ties nothing: a tied checkpoint's own lm_head.weight is used
    (the oracle case above); one without it reads the embedding as the head."""
    from safetensors.torch import load_file, save_file

    path = hf_nemotron_h(tmp_path / "ckpt", tie=True)
    tensors = load_file(path / "model.safetensors")
    assert not torch.equal(tensors["lm_head.weight"], tensors["backbone.embeddings.weight"])
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors")
    ours = load_model(path, world1())
    assert torch.equal(ours.lm_head.weight, tensors["backbone.embeddings.weight"])


def base_config(**overrides) -> dict:
    cfg = dict(TINY_NH, model_type="nemotron_h", mamba_hidden_act="silu", mlp_hidden_act="relu2",
               moe_latent_size=None, time_step_min=0.001)
    cfg.update(overrides)
    return cfg


def test_config_fields():
    cfg = NemotronHConfig.from_dict(base_config())
    assert cfg.num_hidden_layers == 8 and cfg.layers_block_type[3] == "full_attention"
    assert (cfg.mamba_num_heads, cfg.n_groups, cfg.chunk_size) == (8, 2, 4)
    # older configs: the pattern string, legacy block and field names
    legacy = base_config(hybrid_override_pattern="M*-E", mamba_n_groups=4, mamba_chunk_size=16)
    del legacy["layers_block_type"], legacy["n_groups"], legacy["chunk_size"]
    cfg = NemotronHConfig.from_dict(legacy)
    assert cfg.layers_block_type == ("linear_attention", "full_attention", "mlp", "moe")
    assert (cfg.n_groups, cfg.chunk_size) == (4, 16)
    cfg = NemotronHConfig.from_dict(base_config(layers_block_type=["mamba", "attention"]))
    assert cfg.layers_block_type == ("linear_attention", "full_attention")


@pytest.mark.parametrize("overrides,field", [
    (dict(moe_latent_size=32), "moe_latent_size"),
    (dict(layers_block_type=["mamba", "cross"]), "layers_block_type"),
    (dict(mamba_hidden_act="gelu"), "mamba_hidden_act"),
    (dict(mlp_hidden_act="gelu"), "mlp_hidden_act"),
    (dict(n_groups=3), "n_groups"),
    (dict(n_group=3), "n_routed_experts"),
    (dict(topk_group=5), "topk_group"),
    (dict(sliding_window=16), "sliding_window"),
    (dict(ssm_state_size=None), "ssm_state_size"),
])
def test_config_rejects_unsupported(overrides, field):
    with pytest.raises(CheckpointError, match=field):
        NemotronHConfig.from_dict(base_config(**overrides))


@pytest.mark.parametrize("overrides,dims,field", [
    (dict(num_attention_heads=12, num_key_value_heads=4), ParallelDims(world_size=8, tp=8),
     "num_attention_heads"),
    # 3 ranks: neither n_groups=2 nor tp=3 divides the other (heads 12 split fine)
    (dict(mamba_num_heads=12, num_attention_heads=12, num_key_value_heads=3),
     ParallelDims(world_size=3, tp=3), "n_groups"),
    (dict(mamba_num_heads=6, n_groups=2), ParallelDims(world_size=4, tp=4), "mamba_num_heads"),
    (dict(num_key_value_heads=3, num_attention_heads=12, mamba_num_heads=12, n_groups=4),
     ParallelDims(world_size=4, tp=4, moe_ep=4), "num_key_value_heads"),
    (dict(intermediate_size=90), ParallelDims(world_size=4, tp=4, attn_dp=4), "intermediate_size"),
    (dict(n_routed_experts=6, n_group=3, topk_group=2), ParallelDims(world_size=4, tp=4, moe_ep=4),
     "n_routed_experts"),
    (dict(moe_intermediate_size=50), ParallelDims(world_size=4, tp=4, attn_dp=4),
     "moe_intermediate_size"),
    (dict(moe_shared_expert_intermediate_size=6), ParallelDims(world_size=4, tp=4, moe_ep=4),
     "moe_shared_expert_intermediate_size"),
])
def test_check_parallel_names_the_field(overrides, dims, field):
    cfg = NemotronHConfig.from_dict(base_config(**overrides))
    with pytest.raises(ValueError, match=field):
        check_parallel(cfg, dims)
    check_parallel(cfg, ParallelDims())  # world 1 always fits


def test_plan_builds_on_meta_with_one_stage_per_block(tmp_path, capsys, restore_logger):
    """``layer-boundary plan`` builds the model on the meta device: one stage per block,
    mixers as attention-kind stages, MLP/MoE as FFN stages."""
    path = hf_nemotron_h(tmp_path / "ckpt")
    out = cli_ok(["plan", "--model", str(path), "--tp", "4", "--dp", "2",
                  "--boundary-reduction", "rs+rsv", "--tokens", "5,0", "--json"], capsys)
    plan = json.loads(out)
    kinds = {"linear_attention": "attn", "full_attention": "attn", "mlp": "ffn", "moe": "ffn"}
    assert [s["stage"] for s in plan["stages"]] == [
        f"layer{i}.{kinds[k]}" for i, k in enumerate(TINY_NH["layers_block_type"])]
    assert plan["mode"] == "rsv" and [r["local"] for r in plan["ranks"]] == [5, 5, 0, 0]
