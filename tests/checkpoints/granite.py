"""Tiny Granite and GraniteMoE checkpoints (transformers' save_pretrained, every weight random,
norms included): 4 layers (pp 2 splits them), 4 heads of 8 over 2 kv heads, every multiplier
away from 1 and from the value it replaces (the softmax scale 1/8, not 8 ** -0.5; a residual
multiplier of 0.22, which no binary fraction holds exactly, as the released models').
GraniteMoE: 4 experts of 32 (ep 2: two a rank; ep 4: one), 2 chosen per token, stored fused
(``block_sparse_moe.input_linear`` / ``output_linear``)."""

from __future__ import annotations

from pathlib import Path

from . import save_random

TINY_GRANITE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                    bos_token_id=2, eos_token_id=0, pad_token_id=1, embedding_multiplier=4.0,
                    attention_multiplier=0.125, residual_multiplier=0.22, logits_scaling=2.5)
TINY_GRANITEMOE = dict(TINY_GRANITE, intermediate_size=32, num_local_experts=4,
                       num_experts_per_tok=2)


def hf_granite(path: Path, seed: int = 0, **overrides) -> Path:
    return save_random("GraniteForCausalLM", "GraniteConfig", path, seed,
                       {**TINY_GRANITE, **overrides})


def hf_granitemoe(path: Path, seed: int = 0, **overrides) -> Path:
    return save_random("GraniteMoeForCausalLM", "GraniteMoeConfig", path, seed,
                       {**TINY_GRANITEMOE, **overrides})
