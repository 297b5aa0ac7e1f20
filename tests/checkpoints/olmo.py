"""Tiny OLMo-2 and OLMo-3 checkpoints (transformers' save_pretrained, every weight random)."""

from __future__ import annotations

from pathlib import Path

import torch

# 4 layers (pp 2 and 3 split them), 4 heads of 8 over 2 kv heads
TINY_OLMO = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                 max_position_embeddings=64, eos_token_id=0, pad_token_id=1)
# OLMo-3's default schedule (layer 3 full, the others sliding) with a window shorter than the
# prompts and their decode steps
OLMO3_WINDOW = 3


def _save(cls: str, config_cls: str, path: Path, seed: int, overrides: dict) -> Path:
    import transformers

    from . import randomize

    torch.manual_seed(seed)
    model = getattr(transformers, cls)(getattr(transformers, config_cls)(**{**TINY_OLMO,
                                                                          **overrides}))
    randomize(model)
    model.save_pretrained(path)
    return Path(path)


def hf_olmo2(path: Path, seed: int = 0, **overrides) -> Path:
    return _save("Olmo2ForCausalLM", "Olmo2Config", path, seed, overrides)


def hf_olmo3(path: Path, seed: int = 0, **overrides) -> Path:
    return _save("Olmo3ForCausalLM", "Olmo3Config", path, seed,
                 {"sliding_window": OLMO3_WINDOW, **overrides})
