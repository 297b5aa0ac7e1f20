"""OLMo-3 with layer boundaries: OLMo-2 (``olmo2.py``: post norms as residual updates, q/k
norms over every head) with sliding-window layers.

``layer_types`` names each layer's attention (transformers' default: every fourth layer full,
the others sliding); a sliding layer sees its last ``sliding_window`` positions, itself
included, on the positional KV cache (the mask hides the older ones). Each attention type has
its rope (``rope_parameters`` keyed by layer type: default or llama3 here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import FULL, SLIDING, SLIDING_FIELDS, layer_windows
from .llama import check_parallel, read_rope
from .olmo2 import AUTO, Olmo2Config, Olmo2DecoderLayer, PostNormCausalLM
from .registry import NO_MOE_LAYERS, NO_QKV_LATENT, register_model
from .rope import inverse_frequencies


def default_layer_types(layers: int) -> list:
    """transformers' OLMo-3 schedule: every fourth layer full."""
    return [FULL if (i + 1) % 4 == 0 else SLIDING for i in range(layers)]


@dataclass(frozen=True)
class Olmo3Config(Olmo2Config):
    windows: tuple = ()  # each layer's sliding window (None: full)
    ropes: tuple = ()  # each layer's (rope_theta, llama3 scaling or None)
    model_type: str = "olmo3"

    fields = {**Olmo2Config.fields, **SLIDING_FIELDS}

    @classmethod
    def read(cls, cfg: dict) -> dict:
        layers = cfg.get("num_hidden_layers")
        windows = layer_windows(cfg, layers, default_layer_types)
        per_type = cfg.get("rope_parameters") or {}
        if not all(isinstance(per_type.get(t), dict) for t in (SLIDING, FULL)):
            per_type = {t: per_type for t in (SLIDING, FULL)}  # one rope for both types

        def rope(kind: str):
            return read_rope({**cfg, "rope_parameters": per_type[kind], "rope_scaling": None})

        ropes = {kind: rope(kind) for kind in (SLIDING, FULL)}
        plain = {**cfg, "rope_parameters": per_type[FULL], "rope_scaling": None}
        return dict(super().read(plain), windows=windows,
                    ropes=tuple(ropes[SLIDING if w is not None else FULL] for w in windows))

    def window(self, index: int) -> int | None:
        return self.windows[index]

    def layer_frequencies(self, index: int) -> torch.Tensor:
        theta, scaling = self.ropes[index]
        inv_freq = inverse_frequencies(theta, self.head_dim)
        return inv_freq if scaling is None else scaling.scale(inv_freq)


@register_model("olmo3", Olmo3Config, architectures=("Olmo3ForCausalLM",),
                boundary_reduction=AUTO, positional_cache=True,  # AUTO: measured in olmo2.py
                check_parallel=check_parallel, context_parallel=True, sequence_parallel=True,
                attn_input_scattered=NO_QKV_LATENT, moe_a2a=NO_MOE_LAYERS)
class Olmo3ForCausalLM(PostNormCausalLM):
    """OLMo-3: OLMo-2's layers, sliding or full by ``layer_types``."""

    layer_cls = Olmo2DecoderLayer
