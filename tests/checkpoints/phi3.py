"""Tiny Phi-3 checkpoints (transformers' save_pretrained, every weight random): 4 layers
(pp 2 splits them), 4 heads of 8 over 2 kv heads, half of each head rotating, a sliding
window shorter than the prompts and their decode steps. Phi-3's default pad and eos ids
(32000) lie past the tiny vocabulary: eos is set, save_random drops pad."""

from __future__ import annotations

from pathlib import Path

from . import save_random

WINDOW = 4
TINY_PHI3 = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 eos_token_id=0, sliding_window=WINDOW,
                 partial_rotary_factor=0.5)  # 4 of each head's 8 dims rotate


def hf_phi3(path: Path, seed: int = 0, **overrides) -> Path:
    """Phi-3: fused qkv_proj and gate_up_proj, partial rotary, the sliding window."""
    return save_random("Phi3ForCausalLM", "Phi3Config", path, seed,
                       {**TINY_PHI3, **overrides})
