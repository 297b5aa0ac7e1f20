"""The stack's two ends as models vary them: a scaled embedding, and an LM head that scales,
divides or softcaps its logits (Gemma-3's softcap, Cohere's ``logit_scale``, Granite's
``logits_scaling``). A model builds them in its ``make_embedding`` / ``make_head`` hooks
(``base.CausalLM``), which the skeleton calls where it builds the two ends (and ties the head
to the embedding)."""

from __future__ import annotations

import torch

from ..runtime.embedding import ParallelLMHead, VocabParallelEmbedding


class ScaledEmbedding(VocabParallelEmbedding):
    """The embedding times ``scale``: Gemma-3's ``sqrt(hidden_size)`` rounded to the weight's
    dtype first (``rounded=True``, as ``Gemma3TextScaledWordEmbedding`` casts its fp32
    scalar), Granite's ``embedding_multiplier`` as the Python float transformers multiplies
    by."""

    def __init__(self, *args, scale: float = 1.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.scale


class ScaledLMHead(ParallelLMHead):
    """The LM head whose logits are multiplied by ``scale`` (Cohere's ``logit_scale``), then
    divided by ``divisor`` (Granite's ``logits_scaling``), then softcapped: ``cap *
    tanh(logits / cap)`` (Gemma-3's ``final_logit_softcapping``). None: that step is skipped;
    each in the order and arithmetic transformers uses."""

    def __init__(self, *args, scale: float | None = None, divisor: float | None = None,
                 cap: float | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale, self.divisor, self.cap = scale, divisor, cap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden)
        if self.scale is not None:
            logits = logits * self.scale
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.cap is not None:
            logits = torch.tanh(logits / self.cap) * self.cap
        return logits


def embedding_scale(hidden_size: int, dtype) -> float:
    """Gemma-3's embedding scale: ``sqrt(hidden_size)`` rounded to the weight's dtype."""
    return torch.tensor(hidden_size ** 0.5, device="cpu").to(dtype).item()

