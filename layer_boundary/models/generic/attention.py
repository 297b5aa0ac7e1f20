"""transformers' attention modules over our KV cache: the function registered with
``AttentionInterface`` (``ATTENTION``), and the rotary tables a forward computes once."""

from __future__ import annotations

import inspect

import torch

from ..attention import cached_attention

# what transformers' attention modules pass that changes nothing here: dropout is 0 in eval,
# masks are built from positions (``attention_mask`` is None), the cache is ours
_NEUTRAL = ("dropout", "is_causal", "position_ids", "cache_position", "use_cache",
            "output_attentions")


def boundary_attention(module, query, key, value, attention_mask, *, scaling=None,
                       sliding_window=None, softcap=None, s_aux=None, forward_batch=None,
                       **kwargs):
    """Causal attention of this forward's tokens over the KV cache (``cached_attention``).

    Args:
        module: transformers' attention module (``layer_idx``: its layer in the cache).
        query, key, value: [1, H, T, D], [1, KVH, T, D], [1, KVH, T, Dv]: this rank's heads,
            every token of the forward in one row (requests concatenated), roped.
        attention_mask: None (positions mask, not tensors).
        scaling, sliding_window, softcap, s_aux: as transformers passes them (``s_aux``: a
            sink logit per head).
        forward_batch: the batch, passed through transformers' ``**kwargs``.

    Returns ([1, T, H, Dv], None), as transformers' attention functions do.
    """
    if forward_batch is None:
        raise RuntimeError(f"{type(module).__name__} ran the layer_boundary attention without "
                           "a forward_batch: it is reached through the generic layer only")
    extra = sorted(k for k, v in kwargs.items() if k not in _NEUTRAL and v is not None)
    if extra or attention_mask is not None:
        raise RuntimeError(f"{type(module).__name__} passed {extra or ['attention_mask']} to "
                           "its attention function, which the generic path does not honour")
    q = query[0].transpose(0, 1)  # [T, H, D]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, KVH, D]
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    out = cached_attention(module.layer_idx, q, k, v, forward_batch, scaling, sinks=s_aux,
                           window=sliding_window, softcap=softcap)
    return out[None], None  # [1, T, H, Dv]


def takes_layer_type(rotary) -> bool:
    """Whether the rotary module's forward takes a ``layer_type`` (one table per kind of
    layer: Gemma 3's sliding and full layers)."""
    return "layer_type" in inspect.signature(rotary.forward).parameters


def position_embeddings(rotary, forward_batch, layer_type, dtype):
    """(cos, sin) [1, T, D] of this forward's positions from transformers' rotary module,
    computed once per forward (and per layer type)."""

    def compute():
        positions = forward_batch.positions[None]  # [1, T]
        x = torch.empty(0, dtype=dtype, device=positions.device)
        if layer_type is None:
            return rotary(x, positions)
        return rotary(x, positions, layer_type)

    return forward_batch.per_forward(("generic rotary", layer_type), compute)
