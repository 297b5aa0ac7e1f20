"""The fused terminal: a terminal MoE's finalize left to the final norm.

A provider whose ``can_defer_finalize`` accepts the terminal layer (the reference one with
``terminal_finalize=True``) lets the last MoE return a ``HandoffOutput`` that the final norm
receives. The model passes the provider's service as
``residual_batch.norm(h, forward_batch, final_norm, handoff_norm=service)``; the norm calls
``service.finalize(handoff, residual, gamma)``, which runs the finalize, the TP all-reduce,
the fp32 residual add and the zero-centered norm (``gamma``: the final norm's
``gemma_weight``) as one step. ``TerminalFinalizeNorm`` is that step in torch ops: the seam a
fused GPU kernel fills, with the same arguments. ``install_fusion(model, provider)`` (the
package root) puts a provider on a built model's stages; ``CausalLM.install_fusion`` also
takes its service for the final norm.

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
    """finalize + all-reduce over ``group`` + residual add + GemmaRMSNorm (epsilon ``eps``;
    None: the final norm has none, and the service declines), in one call; ``calls`` counts
    the completions it performed.

    Args:
        group: the TP group the handoff is a partial over.
        eps: the final norm's epsilon (None: decline every call).
        add_norm: ``add_norm(value, residual, gamma, eps) -> (normed, residual)``, a kernel
            for the add and the zero-centered norm after the sum (None: torch ops).
        dtypes: the residual dtypes ``add_norm`` takes (None: any); others are declined.
    """

    def __init__(self, group, eps: float | None, add_norm=None, dtypes=None) -> None:
        self.group, self.eps, self.calls = group, eps, 0
        self.add_norm, self.dtypes = add_norm, dtypes

    def finalize(self, handoff, residual: torch.Tensor, gamma: torch.Tensor | None):
        """(normed output, new residual) on the residual's rows, or None to decline (before
        it finalizes anything or starts the collective).

        Args:
            handoff: the terminal MoE's ``HandoffOutput`` (or an already finalized tensor),
                on the residual's rows, a partial over ``group``.
            residual: the residual stream on the same rows.
            gamma: the final norm's ``gemma_weight`` (None: not a zero-centered norm).
        """
        if gamma is None or self.eps is None or (
                self.dtypes is not None and residual.dtype not in self.dtypes):
            return None
        value = handoff.complete() if isinstance(handoff, HandoffOutput) else handoff
        value = all_reduce_rows(value, self.group, site=SITE)
        if self.add_norm is not None:
            self.calls += 1
            return self.add_norm(value, residual, gamma, self.eps)
        acc = accumulate_dtype(residual.dtype)
        total = residual.to(dtype=acc) + value.to(dtype=acc)
        self.calls += 1
        return (gemma_rms_fp32(total, gamma, self.eps, residual.dtype),
                total.to(dtype=residual.dtype))
