"""Tiny Inkling (text) checkpoints (transformers' save_pretrained, every weight random): 4
layers (pp 2 splits them), sliding and full ones with a window and a relative extent shorter
than the prompts and their decode steps, dense and MoE layers (8 routed experts, top 2, 2
shared), kernel-4 short convolutions. The learned scales (``global_scale``), the relative
profiles and the convolutions are randomized too, so that each counts."""

from __future__ import annotations

from pathlib import Path

import torch

from . import save_random

TINY_INKLING = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4,
                    swa_num_key_value_heads=4, swa_head_dim=8, sliding_window_size=3, d_rel=4,
                    rel_extent=5, intermediate_size=64, moe_intermediate_size=16,
                    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
                    conv_kernel_size=4, logits_mup_width_multiplier=2.0, route_scale=2.0,
                    max_position_embeddings=64, eos_token_id=0, pad_token_id=1,
                    bos_token_id=None)
# sliding, full, sliding, full; dense, sparse, dense, sparse: each pipeline half holds all
LAYERS = dict(local_layer_ids=[0, 2], mlp_layer_types=["dense", "sparse"] * 2)


def _scales(model) -> None:
    """What ``randomize`` leaves at its init: the learned scales around 1, the relative
    profiles at unit scale."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("global_scale"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("rel_logits_proj.proj"):
                p.normal_(0.0, 1.0)


def hf_inkling(path: Path, seed: int = 0, **overrides) -> Path:
    return save_random("InklingForCausalLM", "InklingTextConfig", path, seed,
                       {**TINY_INKLING, **LAYERS, **overrides}, prepare=_scales)
