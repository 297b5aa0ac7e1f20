"""Tiny random GLM-4.5 (glm4_moe) checkpoints written by transformers' save_pretrained
(experts one per expert on disk), every weight randomised, e_score_correction_bias included."""

from __future__ import annotations

from pathlib import Path

import torch

from . import hf_oracle, randomize

# 3 layers: dense, MoE, MoE. GQA 4 heads of 16 over 2 kv heads (tp 4 replicates kv heads), the
# default partial rotary (8 of 16 dims), q/k norms and q/k/v biases; 8 routed experts in 2
# groups of 4, top-2 from the best group, one shared expert. Sizes divide tp 4, moe_ep 4 and
# moe_tp 4.
TINY_GLM = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                max_position_embeddings=64)


def hf_glm4_moe(path: Path, *, seed: int = 0, tie: bool = False, rope_theta: float = 1e4,
                partial_rotary_factor: float = 0.5, **overrides) -> Path:
    """save_pretrained of a random transformers Glm4MoeForCausalLM."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Glm4MoeConfig(**dict(TINY_GLM, **overrides), tie_word_embeddings=tie,
                                     rope_parameters={"rope_type": "default",
                                                      "rope_theta": rope_theta,
                                                      "partial_rotary_factor":
                                                          partial_rotary_factor})
    model = transformers.Glm4MoeForCausalLM(cfg)
    randomize(model)
    model.save_pretrained(path)
    return Path(path)


def hf_glm4_moe_reference(path: Path):
    return hf_oracle("Glm4MoeForCausalLM", path)
