"""Reference model integrations, chosen by ``model_type`` in config.json."""

from __future__ import annotations

from pathlib import Path

import torch

from .loader import CheckpointError, iter_weights, read_config, validate_config


# model_type -> (module, config class, model class); imported on first use
MODELS = {
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "nemotron_h": ("nemotron_h", "NemotronHConfig", "NemotronHForCausalLM"),
    "longcat_flash": ("longcat_flash", "LongcatFlashConfig", "LongcatFlashForCausalLM"),
    "deepseek_v4": ("deepseek_v4", "DeepseekV4Config", "DeepseekV4ForCausalLM"),
}


def model_classes(model_type: str):
    """(config class, model class, module) of a registered model type."""
    import importlib

    module_name, config_name, model_name = MODELS[model_type]
    module = importlib.import_module(f".{module_name}", __name__)
    return getattr(module, config_name), getattr(module, model_name), module


def _supported_type(raw: dict) -> str:
    model_type = raw.get("model_type")
    if model_type not in MODELS:
        raise CheckpointError(f"config.json model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(sorted(MODELS))})")
    return model_type


def model_type_of(path) -> str:
    return _supported_type(read_config(path))


def _load_config(path):
    """(config, model class) from one read of config.json."""
    raw = read_config(path)
    config_cls, model_cls, _ = model_classes(_supported_type(raw))
    validate_config(raw)
    return config_cls.from_dict(raw), model_cls


def load_config(path):
    return _load_config(path)[0]


def load_model(path, runtime, dtype=torch.float32, fusions=None, options=()):
    """Build the model for the checkpoint at ``path`` on ``runtime`` and load its shard.

    ``options``: (name, value) engine options that replace config fields the checkpoint does
    not set (such as DeepSeek-V3's ``shared_experts_tp1``).
    """
    import dataclasses

    path = Path(path)
    cfg, model_cls = _load_config(path)
    kwargs = {} if fusions is None else {"fusions": fusions}
    try:
        cfg = dataclasses.replace(cfg, **dict(options))
    except TypeError:
        raise ValueError(f"model options {sorted(dict(options))} do not apply to "
                         f"{cfg.model_type}") from None
    model = model_cls(cfg, runtime, dtype=dtype, **kwargs)
    model.load_weights(iter_weights(path))
    return model.eval()
