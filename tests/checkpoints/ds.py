"""Tiny random DeepSeek-V3 checkpoints written by transformers' save_pretrained (the oracle's own
format: experts one per expert on disk), every weight randomised so the checks mean something."""

from __future__ import annotations

from pathlib import Path

import torch

from . import hf_oracle, randomize

# 3 layers: dense, MoE, MoE. 8 routed experts in 4 groups of 2, top-2 from the best 2 groups.
# Sizes divide tp 4, moe_ep 4 and moe_tp 4.
TINY_DS = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
               first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=32, qk_rope_head_dim=8,
               qk_nope_head_dim=16, v_head_dim=16, n_group=4, topk_group=2,
               routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
               max_position_embeddings=64)


def hf_deepseek_v3(path: Path, *, seed: int = 0, tie: bool = False, rope_theta: float = 1e4,
                   **overrides) -> Path:
    """save_pretrained of a random transformers DeepseekV3ForCausalLM."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(**dict(TINY_DS, **overrides), tie_word_embeddings=tie,
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": rope_theta})
    model = transformers.DeepseekV3ForCausalLM(cfg)
    randomize(model)
    model.save_pretrained(path)
    return Path(path)


def hf_deepseek_v3_nextn(path: Path, **kwargs) -> Path:
    """``hf_deepseek_v3`` with a NextN layer stored after its stack (as DeepSeek-V3 ships it;
    transformers' model has no parameter for it)."""
    from layer_boundary.models.nextn import add_nextn_layer

    path = hf_deepseek_v3(path, **kwargs)
    add_nextn_layer(path)
    return path


def hf_deepseek_v3_reference(path: Path):
    return hf_oracle("DeepseekV3ForCausalLM", path)
