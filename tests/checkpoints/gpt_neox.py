"""Tiny GPT-NeoX (Pythia) checkpoints (transformers' save_pretrained, every weight random,
LayerNorm biases included): parallel blocks with two norms, a quarter of each head roped."""

from __future__ import annotations

from pathlib import Path

import torch

from . import save_random

TINY_NEOX = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, max_position_embeddings=64, eos_token_id=0,
                 bos_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                  "partial_rotary_factor": 0.25})


def _norm_biases(model) -> None:
    with torch.no_grad():  # randomize sets norm weights around 1; their biases around 0
        for name, p in model.named_parameters():
            if "layernorm" in name.lower() and name.endswith("bias"):
                p.normal_(0.0, 0.2)


def hf_neox(path: Path, seed: int = 0, **overrides) -> Path:
    return save_random("GPTNeoXForCausalLM", "GPTNeoXConfig", path, seed,
                       {**TINY_NEOX, **overrides}, prepare=_norm_biases)
