"""The post-norm residual update: ``residual + norm(output)``, the norm the producer's own
(OLMo-2/3's and EXAONE-4's per-layer post norms, Gemma-3's sandwich norms).

What it supports, declared here and nowhere inherited:

- not ``plain``: the norm is nonlinear, so the update never moves before the producer's sum
  and no fused add+norm candidate stands in for it; the consumer's read applies it to the
  complete output, then reads (``AddNormRead`` does so for any update it cannot fuse);
- not ``portable``: it holds its layer's weights, so a statically declared partial sum may not
  cross a pipeline cut with it pending (``to_pp`` refuses by name); a sum decided per batch is
  completed and the update applied on the producer's rank, where the weights are;
- per token: it runs on whatever rows the complete output is on (the scattered rows under
  ``rs``/``rsv``, an empty DP rank's none);
- a snapshot refuses it (``snapshot requires a plain residual update``); a capture sees the
  residual it leaves, as for any update.

A sandwich norm is this update on the producer and the ordinary add+norm read (the
consumer's input norm) on the consumer: nothing more to declare.
"""

from __future__ import annotations

import torch

from .add_norm import accumulate_dtype


class PostNormAdd:
    """``residual + norm(contribution)`` with the producer's norm.

    Args:
        norm: the producer's post norm (a module holding its layer's weights); None for a
            neighbour's description of the stage (``elsewhere``), which never applies it.
        name: what errors and reports call it (``layer3.post_attention_layernorm``).
    """

    plain = False
    portable = False  # it holds its layer's weights
    at_producer = False

    def __init__(self, norm, *, name: str | None = None) -> None:
        if norm is not None and not callable(norm):
            raise TypeError(f"PostNormAdd(norm={norm!r}): norm must be the producer's norm "
                            "module (or None for a neighbour's description)")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"PostNormAdd(name={name!r}): name must be a string or None")
        self.norm = norm
        self.name = name or type(norm).__name__

    @classmethod
    def of(cls, layer, attr: str, index: int) -> PostNormAdd:
        """Layer ``index``'s post norm ``attr``: the layer's own module, or (``layer`` None:
        the declaration a neighbour rebuilds on another rank) a description that never runs.

        Args:
            layer: the layer being built, or None for a neighbour's declaration.
            attr: the norm's attribute (and checkpoint) name on the layer.
            index: the layer's global index.
        """
        name = f"layer{index}.{attr}"
        return cls(getattr(layer, attr), name=name) if layer is not None else cls.elsewhere(name)

    @classmethod
    def elsewhere(cls, name: str) -> PostNormAdd:
        """The update as a neighbour describes it: its weights are on the producer's rank."""
        return cls(None, name=name)

    def apply(self, residual: torch.Tensor | None, contribution: torch.Tensor) -> torch.Tensor:
        if self.norm is None:
            raise RuntimeError(f"{self.name} holds another rank's weights: this post-norm "
                               "update only describes a neighbour's stage")
        normed = self.norm(contribution)
        if residual is None:
            return normed
        acc = accumulate_dtype(residual.dtype)
        return (residual.to(dtype=acc) + normed.to(dtype=acc)).to(dtype=residual.dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"
