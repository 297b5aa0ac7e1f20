"""The fused terminal: a terminal MoE's finalize left to the final norm, and providers
installed on a model after it is built.

A provider whose ``can_defer_finalize`` accepts the terminal layer (the reference one with
``terminal_finalize=True``) lets the last MoE return a ``HandoffOutput`` that the final norm
receives. The model passes the provider's service as
``residual_batch.norm(h, forward_batch, final_norm, handoff_norm=service)``; the norm calls
``service.finalize(handoff, residual, gamma)``, which runs the finalize, the TP all-reduce,
the fp32 residual add and the zero-centered norm (``gamma``: the final norm's
``gemma_weight``) as one step. ``TerminalFinalizeNorm`` is that step in torch ops: the seam a
fused GPU kernel fills, with the same arguments.

The norm asks the service only where one all-reduce lands the handoff on the residual's own
rows: a final norm with a ``gemma_weight``, a handoff owing at most the TP sum, a residual on
this rank's local rows that the handoff's rows match (a reduce-scatter mode keeps the
residual scattered; attention DP leaves the handoff on every DP rank's rows, a slice the
kernel does not take). Anywhere else, or when the service returns None, the norm completes the
handoff unfused, as it would without a service.
"""

from __future__ import annotations

import torch

from ..output import HandoffOutput
from ..residual.add_norm import accumulate_dtype
from ..runtime.collectives import all_reduce_rows
from ..runtime.norm import gemma_rms_fp32

SITE = "final_norm.fused"  # the ledger site of the service's all-reduce


class TerminalFinalizeNorm:
    """finalize + all-reduce over ``group`` + residual add + GemmaRMSNorm (epsilon ``eps``),
    in one call; ``calls`` counts the completions it performed."""

    def __init__(self, group, eps: float) -> None:
        self.group, self.eps, self.calls = group, eps, 0

    def finalize(self, handoff, residual: torch.Tensor, gamma: torch.Tensor | None):
        """(normed output, new residual) on the residual's rows, or None to decline (before
        it finalizes anything or starts the collective).

        Args:
            handoff: the terminal MoE's ``HandoffOutput`` (or an already finalized tensor),
                on the residual's rows, a partial over ``group``.
            residual: the residual stream on the same rows.
            gamma: the final norm's ``gemma_weight`` (None: not a zero-centered norm).
        """
        if gamma is None:
            return None
        value = handoff.complete() if isinstance(handoff, HandoffOutput) else handoff
        value = all_reduce_rows(value, self.group, site=SITE)
        acc = accumulate_dtype(residual.dtype)
        total = residual.to(dtype=acc) + value.to(dtype=acc)
        self.calls += 1
        return gemma_rms_fp32(total, gamma, self.eps, residual.dtype), total.to(dtype=residual.dtype)


def install_fusion(model, provider) -> int:
    """Install ``provider`` on every stage boundary a built model's layers hold (a decoder
    layer's ``attn_boundary`` and ``ffn_boundary``, and any other: a branch's stages, a
    single-stage block's), rebuilding each bound stage's plan once: a plan's fusion choices
    are made at construction, never per forward. Every stage takes the same provider, as a
    producer and its consumer must. Call it before the first forward and before
    ``torch.compile``.

    Args:
        model: the model (any ``nn.Module``) whose layers hold the boundaries.
        provider: the fusion provider (``fusions.FusionProvider``).

    Returns how many stages took it.
    """
    from ..stage import stage_boundaries

    stages = stage_boundaries(model)
    if not stages:
        raise ValueError(f"install_fusion found no stage boundary in {type(model).__name__} "
                         "(a decoder layer's attn_boundary / ffn_boundary)")
    for boundary in stages:
        boundary.fusions = provider
        if boundary.bound:  # an unbound stage builds its plan with it when its stack binds it
            boundary.bind(boundary.declaration, boundary.following)
    return len(stages)
