"""The reference models' checkpoints the feature-matrix tests share (pipeline, two-batch
overlap): four or more layers each, so a 3-stage pipeline splits unevenly; Qwen3 tied, so a
later stage's head reads the embedding."""

from __future__ import annotations

import functools

import torch
from checkpoints import hf_qwen3, hf_qwen3_moe, hf_reference, hf_reference_moe
from checkpoints.ds import hf_deepseek_v3, hf_deepseek_v3_reference
from checkpoints.ds4 import TINY_DS4, hf_deepseek_v4, hf_deepseek_v4_reference
from checkpoints.lc import hf_longcat_flash, hf_longcat_flash_reference
from checkpoints.nh import hf_nemotron_h, hf_nemotron_h_reference

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))
STEPS = 3

# (writer, transformers reference, overrides): four or more layers, so pp 3 splits unevenly;
# Qwen3 tied, so a later stage's head reads the embedding
MODELS = {
    "qwen3": (hf_qwen3, hf_reference, dict(num_hidden_layers=4, tie=True)),
    "qwen3_moe": (hf_qwen3_moe, hf_reference_moe, dict(num_hidden_layers=4)),
    "deepseek_v3": (hf_deepseek_v3, hf_deepseek_v3_reference, dict(num_hidden_layers=4)),
    "deepseek_v4": (hf_deepseek_v4, hf_deepseek_v4_reference, dict(
        num_hidden_layers=4, layer_types=TINY_DS4["layer_types"][:1] * 4,
        mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"])),
    "nemotron_h": (hf_nemotron_h, hf_nemotron_h_reference, {}),  # 8 blocks
    "longcat_flash": (hf_longcat_flash, hf_longcat_flash_reference, dict(num_layers=4)),
}


def write_all(root) -> dict[str, str]:
    return {name: str(write(root / name, **kw)) for name, (write, _, kw) in MODELS.items()}


@functools.cache
def transformers_prefill(model: str, path: str) -> list[torch.Tensor]:
    """transformers' logits at the last position of every prompt."""
    ref = MODELS[model][1](path)
    with torch.no_grad():
        return [ref(torch.tensor([p])).logits[0, -1] for p in PROMPTS]
