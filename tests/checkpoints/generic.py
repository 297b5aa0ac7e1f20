"""A tiny random checkpoint of any transformers causal LM, for the Transformers backend
(``layer_boundary.models.generic``): transformers' own config of a ``model_type`` at the
suite's tiny sizes, its causal LM built from it and written by save_pretrained, every weight
random (``randomize``)."""

from __future__ import annotations

from pathlib import Path

import torch

from . import TINY, TOKEN_FIELDS, randomize


def hf_tiny(model_type: str, path: Path, seed: int = 0, **overrides) -> Path:
    """save_pretrained of a random transformers ``AutoModelForCausalLM`` of ``model_type``
    (fp32), its config ``AutoConfig.for_model(model_type, **TINY, **overrides)``. A
    special-token id the config defaults beyond the tiny vocabulary is set to None unless
    ``overrides`` names it (as ``save_random`` does).

    Args:
        model_type: transformers' name of the architecture ("qwen2", "llama", ...).
        path: where to write it.
        seed: the torch seed of its weights.
        overrides: config fields beyond (or replacing) ``TINY``'s.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **dict(TINY, **overrides))
    vocab = getattr(config, "vocab_size", None)
    for name in TOKEN_FIELDS:
        value = getattr(config, name, None)
        if (name not in overrides and isinstance(value, int) and vocab is not None
                and value >= vocab):
            setattr(config, name, None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    model.save_pretrained(path)
    return Path(path)
