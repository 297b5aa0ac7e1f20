"""Reference model integrations: each model file registers its class for a ``model_type``
(``registry.py``); this module reads checkpoints through that registry."""

from __future__ import annotations

from pathlib import Path

import torch

from ..runtime.args import resolve_boundary_reduction
from .config import CheckpointError, read_config  # noqa: F401
from .loader import dequantized, iter_weights
from .registry import auto_policy, model_class, model_types, register_model  # noqa: F401


def model_class_of(path) -> type:
    """The model class serving the checkpoint at ``path``."""
    return model_class(read_config(path).get("model_type"))


def _load_config(path):
    """(config, model class) from one read of config.json, its fields checked first."""
    raw = read_config(path)
    model_cls = model_class(raw.get("model_type"))
    model_cls.config_class.validate(raw)
    return model_cls.config_class.from_dict(raw), model_cls


def load_config(path):
    return _load_config(path)[0]


def boundary_reduction(value: str, checkpoint) -> str:
    """``--boundary-reduction`` resolved for a checkpoint: ``auto`` is its architecture's
    policy (``registry.auto_policy``: its ``architectures`` entry, else its ``model_type``,
    else its ``text_config``'s).

    Args:
        value: ar | rs | rsv | rs+rsv | auto.
        checkpoint: the checkpoint folder, or its config.json as a dict.
    """
    raw = checkpoint if isinstance(checkpoint, dict) else read_config(checkpoint)
    return resolve_boundary_reduction(value, auto_policy(raw)[0])


def load_model(path, runtime, dtype=torch.float32, fusions=None, options=(), read=None):
    """Build the model for the checkpoint at ``path`` on ``runtime`` and load its shard.

    Args:
        path: a Hugging Face checkpoint folder (config.json + safetensors).
        runtime: the ``BoundaryRuntime`` to build its stages on.
        dtype: the parameters' dtype.
        fusions: a fusion provider for every stage.
        options: (name, value) engine options that replace config fields the checkpoint does
            not set (such as DeepSeek-V3's ``shared_experts_tp1``).
        read: a ``runtime.shards.ReadBytes`` that counts the bytes this rank reads (each
            sharded layer reads only its shard).
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
    # an FP8 checkpoint's weights dequantized as they stream in (CPU: the matmuls run on them)
    model.load_weights(dequantized(iter_weights(path, lazy=True, read=read),
                                   getattr(cfg, "fp8_block", None)))
    return model.eval()
