"""Tiny random LongCat-Flash checkpoints written by transformers' save_pretrained (the oracle's
own format: experts one per expert on disk, the identity experts' unused gate/up projections
included), every weight randomised so the checks mean something."""

from __future__ import annotations

from pathlib import Path

import torch

from . import hf_oracle, randomize

# 2 decoder layers (4 attentions). 8 routed + 2 zero (identity) experts, top-2. Sizes divide
# tp 4, moe_ep 4 and moe_tp 4; head_dim must equal qk_rope_head_dim (transformers builds the
# rotary embedding with head_dim).
TINY_LC = dict(vocab_size=96, hidden_size=64, num_layers=2, num_attention_heads=4,
               num_key_value_heads=4, ffn_hidden_size=96, expert_ffn_hidden_size=32,
               n_routed_experts=8, zero_expert_num=2, moe_topk=2, q_lora_rank=16,
               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8,
               v_head_dim=16, routed_scaling_factor=6.0, rms_norm_eps=1e-6,
               max_position_embeddings=64)

# correction bias of the zero experts: enough to win some tokens' choice, not all of them
ZERO_EXPERT_BIAS = 0.03


def hf_longcat_flash(path: Path, *, seed: int = 0, tie: bool = False, rope_theta: float = 1e4,
                     zero_bias: float = ZERO_EXPERT_BIAS, **overrides) -> Path:
    """save_pretrained of a random transformers LongcatFlashForCausalLM."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LongcatFlashConfig(**dict(TINY_LC, **overrides), tie_word_embeddings=tie,
                                          rope_parameters={"rope_type": "default",
                                                           "rope_theta": rope_theta})
    model = transformers.LongcatFlashForCausalLM(cfg)
    randomize(model)
    routed = cfg.n_routed_experts
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.mlp.router.e_score_correction_bias
            bias[:routed] = 0.05 * torch.randn(routed)
            bias[routed:] = zero_bias
    model.save_pretrained(path)
    return Path(path)


def hf_longcat_flash_reference(path: Path):
    return hf_oracle("LongcatFlashForCausalLM", path)
