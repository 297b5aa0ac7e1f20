"""Tiny Gemma-3 (text) checkpoints (transformers' save_pretrained, every weight random): 4
layers (pp 2 splits them), 4 heads of 8 over 2 kv heads, sliding and full layers with a
window shorter than the prompts and their decode steps. ``checkpoints.exaone4`` shares them."""

from __future__ import annotations

from pathlib import Path

from . import save_random  # noqa: F401 - the shared writer, re-exported

TINY_GEMMA3 = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=64, eos_token_id=0, pad_token_id=1)
WINDOW = 3
# sliding, full, sliding, full: each pipeline half holds both kinds
LAYER_TYPES = ["sliding_attention", "full_attention"] * 2


def hf_gemma3(path: Path, seed: int = 0, **overrides) -> Path:
    """Gemma-3 text: sandwich norms, its default ropes (1e6 full, 1e4 sliding), its default
    query_pre_attn_scalar, a tied head."""
    return save_random("Gemma3ForCausalLM", "Gemma3TextConfig", path, seed,
                       {**TINY_GEMMA3, "sliding_window": WINDOW, "layer_types": LAYER_TYPES,
                        **overrides}, zero_centered=True)
