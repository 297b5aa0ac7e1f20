"""Tiny random DeepSeek-V4 checkpoints written by transformers' save_pretrained (the oracle's
own format: the original DeepSeek tensor names, experts one per expert on disk), every weight
randomised so the checks mean something: norms, mHC coefficients, attention sinks, router
biases and the hash layers' token -> expert table included."""

from __future__ import annotations

from pathlib import Path

import torch

from . import hf_oracle, randomize

# 3 layers: hash-routed, top-k routed, hash-routed. Sliding window 4 (prompts run past it).
# 8 heads in 4 output groups, head_dim 16 with 8 rope channels; q_lora_rank (24) differs from
# head_dim so the q and kv norms cannot be swapped. Sizes divide tp 4, moe_ep 4 and moe_tp 4.
TINY_DS4 = dict(vocab_size=96, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=8, num_key_value_heads=1, head_dim=16, q_lora_rank=24,
                partial_rotary_factor=0.5, o_groups=4, o_lora_rank=8, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, sliding_window=4, hc_mult=3,
                hc_sinkhorn_iters=5, routed_scaling_factor=1.5, rms_norm_eps=1e-6,
                layer_types=["sliding_attention"] * 3, mlp_layer_types=["hash_moe", "moe",
                                                                         "hash_moe"],
                max_position_embeddings=64)


def hf_deepseek_v4(path: Path, *, seed: int = 0, tie: bool = False, **overrides) -> Path:
    """save_pretrained of a random transformers DeepseekV4ForCausalLM."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.DeepseekV4Config(**dict(TINY_DS4, **overrides), tie_word_embeddings=tie)
    model = transformers.DeepseekV4ForCausalLM(cfg)
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("attn_hc.fn", "ffn_hc.fn", "hc_head.hc_fn", "experts.gate_up_proj",
                              "experts.down_proj")):  # unit-scale outputs
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif name.endswith(("attn_hc.scale", "ffn_hc.scale", "hc_head.hc_scale")):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))  # randomize left these at unit scale
            elif name.endswith(("attn_hc.base", "ffn_hc.base", "hc_head.hc_base", "sinks")):
                p.normal_(0.0, 0.5)
        for layer in model.model.layers:
            table = getattr(layer.mlp.gate, "tid2eid", None)
            if table is not None:  # k distinct experts per token id
                experts = cfg.n_routed_experts
                table.copy_(torch.stack([torch.randperm(experts)[:cfg.num_experts_per_tok]
                                         for _ in range(cfg.vocab_size)]))
    model.save_pretrained(path)
    return Path(path)


def hf_deepseek_v4_reference(path: Path):
    return hf_oracle("DeepseekV4ForCausalLM", path)
