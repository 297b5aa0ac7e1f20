"""Mistral with layer boundaries: Llama's layers (``llama.py``) without biases, and with an
optional sliding attention window.

``sliding_window`` (null: none) as transformers' Mistral masks it: a query at position q sees
the keys at positions q - sliding_window + 1 .. q, itself included; the KV cache keeps them
as a ring (``KVCache(window=...)``), which is then not positional.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .kv_cache import CacheLayout
from .llama import LlamaConfig, LlamaForCausalLM
from .registry import dense, register_model
from .settings import setting


@dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    # transformers' Mistral has no biases: it reads neither attention_bias nor mlp_bias
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = setting(None)
    model_type: str = "mistral"


NO_CP = "its sliding window across a CP cut is not built"


# a draft may not be a Mistral: with a sliding window its cache is a ring that overwrites
# older positions (the class cannot tell per checkpoint, so it says no for all)
@register_model("mistral", MistralConfig, architectures=("MistralForCausalLM",),
                **dense(positional_cache=False, context_parallel=NO_CP))
class MistralForCausalLM(LlamaForCausalLM):
    """Llama's model with the checkpoint's ``sliding_window`` kept by the KV cache."""

    def cache_layout(self) -> CacheLayout:
        # the window as a ring of its last positions (None: every position)
        return dataclasses.replace(super().cache_layout(), window=self.config.sliding_window)
