"""MoE blocks on the Transformers backend: transformers' stacked experts (``moe_tp_experts``
in the tp_plan) with their intermediate split over TP, their output's sum owed to the
boundary."""

from __future__ import annotations

from .config import refuse


def make_experts_ours(experts, name: str, cfg, runtime, dtype) -> None:
    """Shard transformers' experts module ``experts`` (on the meta device; ``name`` in the
    base model) over TP: not served yet, refused by name."""
    raise refuse(cfg.model_type, f"{name} ({type(experts).__name__}) is a MoE experts module "
                 "(moe_tp_experts), which the generic path does not split yet")


def checkpoint_weights(weights, model):
    """(name, tensor) of the checkpoint as the generic model's parameters take them (its
    experts' tensors stacked as transformers stacks them): the checkpoint's own where there are
    no experts."""
    return weights
