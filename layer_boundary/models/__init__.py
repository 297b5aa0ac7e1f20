"""Reference model integrations, chosen by ``model_type`` in config.json."""

from __future__ import annotations

from pathlib import Path

import torch

from .loader import CheckpointError, iter_weights, read_config


def _registry():
    from .qwen3 import Qwen3Config, Qwen3ForCausalLM

    return {"qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def model_type_of(path) -> str:
    cfg = read_config(path)
    model_type = cfg.get("model_type")
    if model_type not in _registry():
        raise CheckpointError(f"config.json model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(sorted(_registry()))})")
    return model_type


def load_config(path):
    cfg = read_config(path)
    config_cls, _ = _registry()[model_type_of(path)]
    return config_cls.from_dict(cfg)


def load_model(path, runtime, dtype=torch.float32):
    """Build the model for the checkpoint at ``path`` on ``runtime`` and load its shard."""
    path = Path(path)
    _, model_cls = _registry()[model_type_of(path)]
    model = model_cls(load_config(path), runtime, dtype=dtype)
    model.load_weights(iter_weights(path))
    return model.eval()
