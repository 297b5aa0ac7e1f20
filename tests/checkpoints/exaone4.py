"""Tiny EXAONE-4 checkpoints (transformers' save_pretrained, every weight random): Gemma-3's
tiny shape (``checkpoints.gemma3``) with transformers' default schedule (every fourth layer
full, unroped beside the sliding window)."""

from __future__ import annotations

from pathlib import Path

from .gemma3 import TINY_GEMMA3, WINDOW, save_random

TINY_EXAONE4 = {k: v for k, v in TINY_GEMMA3.items() if k != "head_dim"}  # it derives it


def hf_exaone4(path: Path, seed: int = 0, **overrides) -> Path:
    return save_random("Exaone4ForCausalLM", "Exaone4Config", path, seed,
                       {**TINY_EXAONE4, "sliding_window": WINDOW, **overrides})
