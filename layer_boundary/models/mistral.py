"""Mistral with layer boundaries: Llama's layers (``llama.py``) without biases, and with an
optional sliding attention window.

``sliding_window`` (null: none) as transformers' Mistral masks it: a query at position q sees
the keys at positions q - sliding_window + 1 .. q, itself included; the KV cache keeps them
as a ring (``KVCache(window=...)``), which is then not positional.
"""

from __future__ import annotations

from dataclasses import dataclass

from .llama import LlamaConfig, LlamaForCausalLM, check_parallel
from .registry import NO_MOE_LAYERS, NO_QKV_LATENT, register_model


@dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    sliding_window: int | None = None
    model_type: str = "mistral"

    # transformers' Mistral has no biases: it reads neither attention_bias nor mlp_bias
    fields = {**{f: c for f, c in LlamaConfig.fields.items()
                 if f not in ("attention_bias", "mlp_bias")}}

    @classmethod
    def read(cls, cfg: dict) -> dict:
        return dict(super().read(cfg), attention_bias=False, mlp_bias=False,
                    sliding_window=cfg.get("sliding_window"))


# a draft may not be a Mistral: with a sliding window its cache is a ring that overwrites
# older positions (the class cannot tell per checkpoint, so it says no for all)
@register_model("mistral", MistralConfig, architectures=("MistralForCausalLM",),
                check_parallel=check_parallel,
                boundary_reduction="rs+rsv", positional_cache=False, sequence_parallel=True,
                context_parallel="its sliding window across a CP cut is not built",
                attn_input_scattered=NO_QKV_LATENT, moe_a2a=NO_MOE_LAYERS,
                batch_invariant=True)
class MistralForCausalLM(LlamaForCausalLM):
    """Llama's model with the checkpoint's ``sliding_window`` kept by the KV cache."""

    def kv_window(self) -> int | None:
        return self.config.sliding_window
