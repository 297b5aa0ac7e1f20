"""Reference model integrations, chosen by ``model_type`` in config.json."""

from __future__ import annotations

from pathlib import Path

import torch

from .loader import CheckpointError, iter_weights, read_config


# model_type -> (module, config class, model class); imported on first use
MODELS = {
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM"),
}


def _registry():
    return MODELS


def model_classes(model_type: str):
    """(config class, model class, module) of a registered model type."""
    import importlib

    module_name, config_name, model_name = MODELS[model_type]
    module = importlib.import_module(f".{module_name}", __name__)
    return getattr(module, config_name), getattr(module, model_name), module


def model_type_of(path) -> str:
    cfg = read_config(path)
    model_type = cfg.get("model_type")
    if model_type not in _registry():
        raise CheckpointError(f"config.json model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(sorted(_registry()))})")
    return model_type


def load_config(path):
    cfg = read_config(path)
    config_cls, _, _ = model_classes(model_type_of(path))
    return config_cls.from_dict(cfg)


def load_model(path, runtime, dtype=torch.float32, fusions=None, options=()):
    """Build the model for the checkpoint at ``path`` on ``runtime`` and load its shard.

    ``options``: (name, value) engine options that replace config fields the checkpoint does
    not set (such as DeepSeek-V3's ``shared_experts_tp1``).
    """
    import dataclasses

    path = Path(path)
    _, model_cls, _ = model_classes(model_type_of(path))
    kwargs = {} if fusions is None else {"fusions": fusions}
    cfg = load_config(path)
    try:
        cfg = dataclasses.replace(cfg, **dict(options))
    except TypeError:
        raise ValueError(f"model options {sorted(dict(options))} do not apply to "
                         f"{cfg.model_type}") from None
    model = model_cls(cfg, runtime, dtype=dtype, **kwargs)
    model.load_weights(iter_weights(path))
    return model.eval()
