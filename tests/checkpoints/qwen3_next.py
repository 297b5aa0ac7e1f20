"""Tiny random Qwen3-Next, Qwen3.5 and Qwen3.5-MoE checkpoints written by transformers'
save_pretrained of their *ForCausalLM classes (the oracle's own format: experts one per expert
on disk), every weight randomised so the checks mean something, the zero-centered norms near
zero and the DeltaNet's decay parameters where a trained model keeps them."""

from __future__ import annotations

from pathlib import Path

import torch

from . import hf_oracle, randomize

# Two consecutive DeltaNets (0-1), gated attention (2, 4), a dense layer (1) among MoEs, a
# terminal attention layer. DeltaNet: 4 key heads of 32 serving 8 value heads of 16 (each key
# head two value heads), so attention tp 4 holds one key head per rank; heads this wide keep
# a random DeltaNet's fp32 rounding near 1e-5 of the logits (narrower ones amplify it).
# Attention: 8 heads of 16 (4 rotary dims), 2 kv heads (replicated at attention tp 4). MoE: 8
# experts, top 2.
COMMON = dict(
    vocab_size=96, hidden_size=64, num_hidden_layers=5,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention",
                 "full_attention"],
    num_attention_heads=8, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    max_position_embeddings=128)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)
TINY_NEXT = dict(COMMON, **MOE, intermediate_size=96, mlp_only_layers=[1])
TINY_35 = dict(COMMON, intermediate_size=96)
TINY_35_MOE = dict(COMMON, **MOE)

# model_type -> (transformers config class, model class, tiny config)
ARCHS = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", TINY_NEXT),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", TINY_35),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", TINY_35_MOE),
}
ZERO_CENTERED = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight",
                 "q_norm.weight", "k_norm.weight")


def randomize_qwen3_next(model) -> None:
    """``randomize`` plus what it cannot know: the zero-centered norms (``1 + w``) get small
    ``w``, the fused in-memory experts (not named ``weight``) unit-scale weights, and A_log /
    dt_bias values that keep every decay rate moderate (the state matters over a prompt)."""
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ZERO_CENTERED):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif name.endswith("linear_attn.A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 4.0)))
            elif name.endswith("linear_attn.dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))


def hf_qwen3_next(path: Path, arch: str = "qwen3_next", *, seed: int = 0, tie: bool = False,
                  **overrides) -> Path:
    """save_pretrained of a random transformers model of ``arch`` (a key of ARCHS; fp32)."""
    import transformers

    config_cls, model_cls, tiny = ARCHS[arch]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**dict(tiny, **overrides), tie_word_embeddings=tie)
    model = getattr(transformers, model_cls)(cfg).float()
    randomize_qwen3_next(model)
    model.save_pretrained(path)
    return Path(path)


def hf_qwen3_next_reference(path: Path, arch: str = "qwen3_next"):
    return hf_oracle(ARCHS[arch][1], path)
