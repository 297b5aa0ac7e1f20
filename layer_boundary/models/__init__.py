"""Reference model integrations: each model file registers its class for a ``model_type``
(``registry.py``); this module reads checkpoints through that registry, each config.json once
(``open_checkpoint``: a ``Checkpoint`` the callers hand along)."""

from __future__ import annotations

import contextlib

from pathlib import Path

import torch

from ..runtime.args import resolve_boundary_reduction
from ..runtime.packed import pack_linears
from .checkpoint import Checkpoint, open_checkpoint  # noqa: F401
from .config import CheckpointError, read_config  # noqa: F401
from .estimate import check_sizes
from .loader import dequantized, iter_weights
from .registry import auto_policy, model_class, model_types, register_model  # noqa: F401


def model_class_of(path) -> type:
    """The model class serving the checkpoint at ``path`` (a folder or a ``Checkpoint``)."""
    return open_checkpoint(path).model_class


def load_config(path):
    """The parsed config of the checkpoint at ``path`` (a folder or a ``Checkpoint``)."""
    return open_checkpoint(path).config


def boundary_reduction(value: str, checkpoint) -> str:
    """``--boundary-reduction`` resolved for a checkpoint: ``auto`` is its architecture's
    policy (``registry.auto_policy``: its ``architectures`` entry, else its ``model_type``,
    else its ``text_config``'s).

    Args:
        value: ar | rs | rsv | rs+rsv | auto.
        checkpoint: a ``Checkpoint``, the checkpoint folder, or its config.json as a dict.
    """
    if isinstance(checkpoint, dict):
        return resolve_boundary_reduction(value, auto_policy(checkpoint)[0])
    return open_checkpoint(checkpoint).boundary_reduction(value)


def building_on(device):
    """Where a model's constructor makes its parameters: ``device`` (a context, the CPU
    included, so an ambient default device does not decide), or the ambient default where
    ``device`` is None."""
    if device is None:
        return contextlib.nullcontext()
    return torch.device(device)


def load_model(path, runtime, dtype=torch.float32, fusions=None, options=(), read=None,
               device=None, pack: bool = True):
    """Build the model for the checkpoint at ``path`` on ``runtime`` and load its shard.

    Args:
        path: a Hugging Face checkpoint folder (config.json + safetensors), or its
            ``Checkpoint`` (config.json is then not read again).
        runtime: the ``BoundaryRuntime`` to build its stages on.
        dtype: the parameters' dtype.
        fusions: a fusion provider for every stage.
        options: (name, value) engine options that replace config fields the checkpoint does
            not set (such as DeepSeek-V3's ``shared_experts_tp1``).
        read: a ``runtime.shards.ReadBytes`` that counts the bytes this rank reads (each
            sharded layer reads only its shard).
        device: where the parameters (and so the KV cache and every tensor a forward makes)
            live (None: the default device, the CPU); each shard is read on the CPU and
            copied into its parameter there.
        pack: lay each CPU linear's weight out for the matmul kernels once it is loaded
            (``runtime.packed``: a wide weight stored transposed in place, and a copy packed
            for oneDNN that eager CPU matmuls of several rows run on: one more copy of those
            weights in memory). False: every matmul runs ``F.linear`` on the weight as
            loaded.
    """
    import dataclasses

    checkpoint = open_checkpoint(path)
    cfg, model_cls, path = checkpoint.config, checkpoint.model_class, Path(checkpoint.folder)
    kwargs = {} if fusions is None else {"fusions": fusions}
    try:
        cfg = dataclasses.replace(cfg, **dict(options))
    except TypeError:
        raise ValueError(f"model options {sorted(dict(options))} do not apply to "
                         f"{cfg.model_type}") from None
    # a config.json asking for more than its checkpoint holds is refused before any memory
    # is allocated (a meta build and the safetensors headers; once per contents)
    check_sizes(checkpoint)
    with building_on(device):
        model = model_cls(cfg, runtime, dtype=dtype, **kwargs)
    # an FP8 checkpoint's weights dequantized as they stream in (CPU: the matmuls run on them)
    model.load_weights(dequantized(iter_weights(path, lazy=True, read=read),
                                   getattr(cfg, "fp8_block", None)))
    if pack:
        pack_linears(model)
    return model.eval()
