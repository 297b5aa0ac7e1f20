"""The stack's two ends as models vary them: a scaled embedding, and an LM head that scales,
divides or softcaps its logits (Gemma-3's softcap, Cohere's ``logit_scale``, Granite's
``logits_scaling``). A model swaps them in with ``rebuilt_as``, which keeps the very weight
(a tie, its shard loader) of the module it replaces."""

from __future__ import annotations

import torch

from ..runtime.embedding import ParallelLMHead, VocabParallelEmbedding


class ScaledEmbedding(VocabParallelEmbedding):
    """The embedding times ``scale``: Gemma-3's ``sqrt(hidden_size)`` rounded to the weight's
    dtype first (``rounded=True``, as ``Gemma3TextScaledWordEmbedding`` casts its fp32
    scalar), Granite's ``embedding_multiplier`` as the Python float transformers multiplies
    by."""

    scale: float = 1.0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.scale


class ScaledLMHead(ParallelLMHead):
    """The LM head whose logits are multiplied by ``scale`` (Cohere's ``logit_scale``), then
    divided by ``divisor`` (Granite's ``logits_scaling``), then softcapped: ``cap *
    tanh(logits / cap)`` (Gemma-3's ``final_logit_softcapping``). None: that step is skipped;
    each in the order and arithmetic transformers uses."""

    scale: float | None = None
    divisor: float | None = None
    cap: float | None = None

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


def rebuilt_as(module: VocabParallelEmbedding, cls: type, **attrs) -> VocabParallelEmbedding:
    """``module`` as ``cls`` (a subclass that only adds to its forward), holding the very same
    weight (a tie, and its shard loader, kept), with ``attrs`` set on it (``scale=``,
    ``cap=``): the shell is built on the meta device, so nothing is allocated twice."""
    with torch.device("meta"):
        new = cls(module.vocab_size, module.weight.shape[1], module.group,
                  dtype=module.weight.dtype)
    new.weight = module.weight
    for name, value in attrs.items():
        setattr(new, name, value)
    return new
