"""Tiny Cohere / Cohere2 (Command-R) checkpoints (transformers' save_pretrained, every weight
random): parallel blocks over Gemma-3's tiny shape; Cohere2's sliding and full layers with a
window shorter than the prompts and their decode steps."""

from __future__ import annotations

from pathlib import Path

from . import save_random
from .gemma3 import LAYER_TYPES, TINY_GEMMA3, WINDOW

TINY_COHERE = {k: v for k, v in TINY_GEMMA3.items() if k != "head_dim"}  # hidden / heads
TINY_COHERE2 = dict(TINY_COHERE, sliding_window=WINDOW, layer_types=LAYER_TYPES)


def hf_cohere(path: Path, seed: int = 0, **overrides) -> Path:
    return save_random("CohereForCausalLM", "CohereConfig", path, seed,
                       {**TINY_COHERE, "logit_scale": 0.5, **overrides})


def hf_cohere2(path: Path, seed: int = 0, **overrides) -> Path:
    return save_random("Cohere2ForCausalLM", "Cohere2Config", path, seed,
                       {**TINY_COHERE2, "logit_scale": 0.5, **overrides})
