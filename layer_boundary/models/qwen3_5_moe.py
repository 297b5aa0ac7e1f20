"""Qwen3.5-MoE (text): Qwen3.5's hybrid stack and split DeltaNet projections
(``qwen3_5.py``) with Qwen3-Next's MoE in every layer (routed experts, always renormalised,
and the sigmoid-gated shared expert). The same two layouts as Qwen3.5: ``qwen3_5_moe_text``
(``Qwen3_5MoeForCausalLM.save_pretrained``) and ``qwen3_5_moe`` (the released multimodal
checkpoint, text config in ``text_config``, language model under
``model.language_model.``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .qwen3_5 import CAPABILITIES, MULTIMODAL_NAMES, TEXT_NAMES, Qwen3_5Config, Qwen3_5Names
from .qwen3_next import Qwen3NextForCausalLM
from .registry import register_model


@dataclass(frozen=True)
class Qwen3_5MoeConfig(Qwen3_5Config):
    model_type: str = "qwen3_5_moe"
    # transformers' Qwen3_5MoeTextConfig has no decoder_sparse_step, mlp_only_layers or
    # norm_topk_prob: every layer is sparse and its top-k weights renormalised
    FIXED: ClassVar[dict] = dict(split_projections=True, decoder_sparse_step=1,
                                 mlp_only_layers=(), norm_topk_prob=True)


MOE_CAPABILITIES = dict(CAPABILITIES, moe_a2a=True)


@register_model("qwen3_5_moe", Qwen3_5MoeConfig,
                architectures=("Qwen3_5MoeForConditionalGeneration",), **MOE_CAPABILITIES)
class Qwen3_5MoeForCausalLM(Qwen3_5Names, Qwen3NextForCausalLM):
    """Qwen3.5-MoE's language model: gated DeltaNet and gated attention, MoE FFNs."""

    transformers_names = MULTIMODAL_NAMES


@register_model("qwen3_5_moe_text", Qwen3_5MoeConfig,
                architectures=("Qwen3_5MoeForCausalLM",), **MOE_CAPABILITIES)
class Qwen3_5MoeTextForCausalLM(Qwen3_5Names, Qwen3NextForCausalLM):
    """Qwen3.5-MoE's language model as transformers' text-only class saves it."""

    transformers_names = TEXT_NAMES
