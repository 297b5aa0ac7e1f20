"""Tiny random Nemotron-H checkpoints written by transformers' save_pretrained (the oracle's own
format: ``backbone.`` names, experts one per expert on disk), every weight randomised so the
checks mean something, with the SSM parameters kept where a real model keeps them (stable)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from . import hf_oracle, randomize

# Every block kind, two consecutive mixers (0-1) and two consecutive FFNs (4-5), a terminal
# MoE. Mamba: 8 heads of 8 in 2 B/C groups, so tp 4 splits a group over 2 ranks (group
# replication and the cross-rank gated norm); chunk 4 makes prefills span several chunks.
# Attention: 8 heads of 8, 2 kv heads. MoE: 8 experts in 4 groups, top-2 of the best 2.
# Sizes divide tp 4, moe_ep 4 and moe_tp 4.
TINY_NH = dict(
    vocab_size=96, hidden_size=64,
    layers_block_type=["linear_attention", "linear_attention", "mlp", "full_attention", "moe",
                       "mlp", "linear_attention", "moe"],
    num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=96,
    mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, conv_kernel=4,
    chunk_size=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=32, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    norm_topk_prob=True, layer_norm_epsilon=1e-5, max_position_embeddings=64)


def randomize_nemotron_h(model) -> None:
    """``randomize`` plus what it cannot know: the fused in-memory experts (not named
    ``weight``) get unit-scale weights, and A_log / D / dt_bias take values like a trained
    model's (decay rates 1..16, a skip near 1, time steps 0.01..0.2 after softplus)."""
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.up_proj", "experts.down_proj")):
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif name.endswith("mixer.A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1.0, 16.0)))
            elif name.endswith("mixer.D"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mixer.dt_bias"):
                dt = torch.exp(torch.empty_like(p).uniform_(math.log(0.01), math.log(0.2)))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus


def hf_nemotron_h(path: Path, *, seed: int = 0, tie: bool = False, **overrides) -> Path:
    """save_pretrained of a random transformers NemotronHForCausalLM (fp32)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.NemotronHConfig(**dict(TINY_NH, **overrides), tie_word_embeddings=tie)
    model = transformers.NemotronHForCausalLM(cfg).float()
    randomize_nemotron_h(model)
    model.save_pretrained(path)
    return Path(path)


def hf_nemotron_h_reference(path: Path):
    return hf_oracle("NemotronHForCausalLM", path)
