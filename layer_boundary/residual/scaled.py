"""The scaled residual update: ``residual + multiplier * contribution``, the multiplier a
constant of the model (Granite's ``residual_multiplier``; SGLang's, sglang#33293).

transformers' Granite computes ``residual + hidden_states * self.residual_multiplier``: the
contribution is scaled, then added. The same order here, with the library's numerics (as the
plain add's, DESIGN.md): the product and the sum formed in fp32, the stored residual rounded
once, and the add+norm read (``AddNormRead``) normalising the fp32 sum. In fp32 that is
transformers' arithmetic exactly (the same two fp32 ops); in bf16 transformers rounds the
product and then the sum to bf16 and normalises the rounded residual, so a bf16 run is
proven against its own world 1, as every model's is.

What it supports, declared here and nowhere inherited:

- not ``plain``: the residual must not join the contribution before the producer's sum (an
  add on one rank before the all-reduce would scale the residual too), so the update never
  moves before a sum, and no fused candidate that adds the value as it is stands in for it
  (``FusedInput`` candidates are offered only where the update is plain; the reference and
  Triton candidates also decline a non-plain update at run time, before touching anything);
- ``portable``: its whole state is a constant of the config, so a neighbour's declaration
  (a pipeline receiver's, rebuilt from the config) applies it identically: a PARTIAL
  attention's declared sum may cross a pipeline cut with the update pending;
- not ``at_producer``: the consumer applies it, on whatever rows the complete output is on
  (the scattered rows under ``rs``/``rsv``, none on an empty DP rank);
- the fused read: ``apply_fp32`` gives the unrounded sum, which ``AddNormRead`` (and so the
  final norm, and the quantized read built on it) rounds once for the residual and passes to
  the norm's ``normalize_fp32``, instead of applying, rounding and reading the rounded value;
- a snapshot and ``add_to_output()`` refuse it, as for any non-plain update (an extra added
  to the output would be scaled); a capture sees the residual it leaves.

A multiplier of 1 is the plain add: a model declares ``PlainAdd`` there (``scaled_update``),
which keeps the plain add's fast paths.
"""

from __future__ import annotations

import torch

from ..runtime.arguments import positive_number
from .add_norm import accumulate_dtype


class ScaledAdd:
    """``residual + multiplier * contribution``.

    Args:
        multiplier: the constant the contribution is scaled by (a Python float, as
            transformers multiplies by it): a positive, finite number, as config.json's
            ``residual_multiplier`` is checked (NaN would make every output NaN; 0 would
            drop the stage), else a TypeError/ValueError naming it.
    """

    plain = False  # the residual must not be added before the sum: it would be scaled too
    portable = True  # stateless but for a constant
    at_producer = False

    def __init__(self, multiplier: float) -> None:
        self.multiplier = positive_number("ScaledAdd", "multiplier", multiplier)

    def apply_fp32(self, residual: torch.Tensor | None,
                   contribution: torch.Tensor) -> torch.Tensor:
        """The updated residual in the accumulation dtype (fp32 for half and single
        precision), unrounded: what the add+norm read normalises and rounds once."""
        acc = accumulate_dtype((contribution if residual is None else residual).dtype)
        scaled = contribution.to(dtype=acc) * self.multiplier  # scaled first, as transformers
        return scaled if residual is None else residual.to(dtype=acc) + scaled

    def apply(self, residual: torch.Tensor | None, contribution: torch.Tensor) -> torch.Tensor:
        dtype = (contribution if residual is None else residual).dtype
        return self.apply_fp32(residual, contribution).to(dtype=dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.multiplier!r})"


def scaled_update(multiplier: float) -> ScaledAdd | None:
    """The update of a residual scaled by ``multiplier``: ``ScaledAdd``, or None (the plain
    add, which ``declare_attn``/``declare_ffn`` default to) where the multiplier is 1 and
    the product exact. ``multiplier`` is checked as ``ScaledAdd`` checks it."""
    multiplier = positive_number("scaled_update", "multiplier", multiplier)
    return None if multiplier == 1.0 else ScaledAdd(multiplier)
