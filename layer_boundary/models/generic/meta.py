"""transformers' own causal-LM model of a config, built on the meta device (no memory) with
its attention set to ours, and the refusal every part of the backend gives."""

from __future__ import annotations

import torch

from ..config import CheckpointError

ATTENTION = "layer_boundary"  # the name our attention function is registered under


def refuse(model_type: str, why: str) -> CheckpointError:
    return CheckpointError(f"the transformers backend cannot serve model_type {model_type!r}: "
                           f"{why}")


def register_attention() -> None:
    """Our attention function under ``ATTENTION`` in transformers' ``AttentionInterface``
    (and its mask interface, which builds no mask for it: our attention masks by position)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from .attention import boundary_attention

    AttentionInterface.register(ATTENTION, boundary_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, lambda *args, **kwargs: None)


def skeleton(hf):
    """transformers' causal-LM model of config ``hf`` on the meta device (no memory), its
    attention set to ours."""
    from transformers import AutoModelForCausalLM

    register_attention()
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(hf, attn_implementation="eager")
        except ValueError as exc:
            raise refuse(hf.model_type, f"transformers builds no causal LM of it ({exc})") from None
    model.config._attn_implementation = ATTENTION
    return model
