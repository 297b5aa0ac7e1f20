"""Tiny Mixtral and MiniMax-M2 checkpoints (transformers' save_pretrained, every weight random,
norms and MiniMax's selection bias included, the bias wide enough to change
many tokens' experts). Both are written in Mixtral's layout
(``block_sparse_moe.experts.{e}.w1/w2/w3``), as transformers converts its fused experts back.

3 layers (pp 2 splits them 2 + 1), 4 heads of 8 over 2 kv heads (replicated over rank pairs at
attention TP 4), 4 experts of 32 (ep 4: one a rank; tp 4 ep 2: each split over 2 ranks),
2 chosen per token. Mixtral's window of 4 is shorter than the test prompts; MiniMax-M2 rotates
half of each head (``rotary_dim`` 4 of 8)."""

from __future__ import annotations

from pathlib import Path

import torch

from . import hf_oracle, randomize

TINY_MIXTRAL = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                    bos_token_id=0, eos_token_id=1)
WINDOW = 4
ROTARY_DIM = 4


def _save(model_cls: str, config_cls: str, path: Path, seed: int, fields: dict) -> Path:
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**{**TINY_MIXTRAL, **fields})
    model = getattr(transformers, model_cls)(cfg)
    randomize(model)
    with torch.no_grad():  # a selection bias as wide as the sigmoid scores' spread: it steers
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return Path(path)


def hf_mixtral(path: Path, *, seed: int = 0, sliding_window: int | None = WINDOW,
               **overrides) -> Path:
    """save_pretrained of a random MixtralForCausalLM (``sliding_window`` None: full
    attention, the config's default)."""
    return _save("MixtralForCausalLM", "MixtralConfig", path, seed,
                 dict(sliding_window=sliding_window, **overrides))


def hf_minimax_m2(path: Path, *, seed: int = 0, rotary_dim: int | None = ROTARY_DIM,
                  **overrides) -> Path:
    """save_pretrained of a random MiniMaxM2ForCausalLM (``rotary_dim`` None: the whole head
    rotates, the config's default)."""
    fields = dict(overrides) if rotary_dim is None else dict(overrides, rotary_dim=rotary_dim)
    return _save("MiniMaxM2ForCausalLM", "MiniMaxM2Config", path, seed, fields)


def hf_mixtral_reference(path: Path):
    return hf_oracle("MixtralForCausalLM", path)


def hf_minimax_m2_reference(path: Path):
    return hf_oracle("MiniMaxM2ForCausalLM", path)
