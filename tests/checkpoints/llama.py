"""Tiny random Llama and Mistral checkpoints written by transformers' save_pretrained (the
oracle's own format), every weight random, norms and biases included.

GQA (8 heads of 16, 2 kv heads, so tp 4 replicates kv heads over rank pairs). The llama3
rope variant stretches head_dim 16's frequencies across all three of its bands at rope_theta
5e5 and an original context of 1024 (3 kept, 1 interpolated, 4 divided by the factor).
Mistral's window of 4 is shorter than the test prompts (5 and 7 tokens, then decode steps)."""

from __future__ import annotations

from pathlib import Path

import torch

from . import TINY, hf_oracle, randomize

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
TINY_LLAMA = dict(TINY, max_position_embeddings=4096)
WINDOW = 4


def _save(config_class: str, model_class: str, path: Path, seed: int, tie: bool, rope: dict,
          **fields) -> Path:
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, config_class)(**dict(TINY_LLAMA, **fields),
                                              tie_word_embeddings=tie, rope_parameters=rope)
    model = getattr(transformers, model_class)(cfg)
    randomize(model)
    model.save_pretrained(path)
    return Path(path)


def hf_llama(path: Path, *, seed: int = 0, tie: bool = False, llama3: bool = False,
             rope_theta: float = 1e4, **overrides) -> Path:
    """save_pretrained of a random transformers LlamaForCausalLM; ``llama3``: Llama 3's rope
    scaling (``LLAMA3_ROPE``, its own theta), else the default rope at ``rope_theta``."""
    rope = dict(LLAMA3_ROPE) if llama3 else {"rope_type": "default", "rope_theta": rope_theta}
    return _save("LlamaConfig", "LlamaForCausalLM", path, seed, tie, rope, **overrides)


def hf_mistral(path: Path, *, seed: int = 0, tie: bool = False, sliding_window: int | None = WINDOW,
               rope_theta: float = 1e4, **overrides) -> Path:
    """save_pretrained of a random transformers MistralForCausalLM (``sliding_window`` None:
    full attention)."""
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    return _save("MistralConfig", "MistralForCausalLM", path, seed, tie, rope,
                 sliding_window=sliding_window, **overrides)


def hf_llama_reference(path: Path):
    return hf_oracle("LlamaForCausalLM", path)


def hf_mistral_reference(path: Path):
    return hf_oracle("MistralForCausalLM", path)
