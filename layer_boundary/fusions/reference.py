"""A reference fusion provider written with torch ops, so ordering, fallback and the
finalize handoff are exercised on CPU. A GPU provider implements the same protocol."""

from __future__ import annotations

from ..contracts import ProducerReduction, StageKind
from ..layout import RowMode, Rows, SumGroup
from ..output import HandoffOutput
from ..residual.add_norm import accumulate_dtype
from . import Arrival, InputPlan


class FusedFinalizeAllReduceAddNorm:
    """finalize (if a handoff) + all-reduce over TP + local slice + fp32 add + norm, as one
    step; accepts only an all-reduce-mode input on global rows that owes a TP sum, or a
    finalize handoff alone (one rank)."""

    def __init__(self, plan: InputPlan) -> None:
        self.plan = plan
        self.calls = 0  # accepted arrivals, for tests

    def __call__(self, arrival: Arrival):
        owed, handoff = arrival.owed, isinstance(arrival.value, HandoffOutput)
        summed = owed is not None and owed.group in (SumGroup.TP, SumGroup.MOE_OUT)
        if (not (summed or (owed is None and handoff)) or arrival.rows is not Rows.GLOBAL
                or not arrival.update.plain or arrival.residual is None
                or arrival.residual_rows is not Rows.LOCAL
                or not hasattr(arrival.norm, "normalize_fp32")):
            return None  # declined before touching anything
        self.calls += 1
        value = arrival.value.complete() if handoff else arrival.value
        rows = arrival.batch_rows
        value = rows.sum_global_partial_to_local(value) if summed else rows.global_to_local(value)
        acc = accumulate_dtype(arrival.residual.dtype)
        total = arrival.residual.to(acc) + value.to(acc)
        residual = total.to(arrival.residual.dtype)
        return arrival.norm.normalize_fp32(total, residual.dtype), residual


class FinalizeNorm:
    """The terminal service for ``residual_batch.norm(..., handoff_norm=...)``."""

    def __init__(self) -> None:
        self.calls = 0

    def finalize(self, arrival: Arrival):
        """(normalised output, residual) on the residual's rows, or None to decline."""
        candidate = FusedFinalizeAllReduceAddNorm(None)
        out = candidate(arrival)
        self.calls += out is not None
        return out


class ReferenceFusions:
    """Offers the fused candidate to FFN and attention inputs in the all-reduce row mode.

    ``defer_finalize``: let sparse FFNs hand their finalize to the next input;
    ``terminal_finalize``: also at the last layer, to the final norm's ``handoff_norm``;
    ``defer_all_reduce``: let a LOCAL_TAIL FFN leave its all-reduce to the next input.
    ``decline``: offer candidates that always decline (to test the fallback).
    """

    def __init__(self, defer_finalize: bool = True, terminal_finalize: bool = False,
                 defer_all_reduce: bool = False, decline: bool = False) -> None:
        self.defer_finalize, self.terminal_finalize = defer_finalize, terminal_finalize
        self.defer_all_reduce, self.decline = defer_all_reduce, decline
        self.candidates: list = []
        self.service = FinalizeNorm()

    def _input(self, plan: InputPlan):
        if plan.mode is not RowMode.AR:
            return []
        candidate = _declining if self.decline else FusedFinalizeAllReduceAddNorm(plan)
        self.candidates.append(candidate)
        return [candidate]

    def attention_input(self, plan: InputPlan):
        return self._input(plan)

    def ffn_input(self, plan: InputPlan):
        return self._input(plan)

    def can_defer_finalize(self, plan, forward_batch) -> bool:
        decl = plan.declaration
        return self.defer_finalize and decl.sparse and (self.terminal_finalize or not decl.terminal)

    def can_defer_all_reduce(self, plan, forward_batch) -> bool:
        decl = plan.declaration
        return (self.defer_all_reduce and decl.kind is StageKind.FFN and not decl.terminal
                and decl.reduction is ProducerReduction.LOCAL_TAIL)

    def handoff_norm(self):
        return None if self.decline or not self.terminal_finalize else self.service

    @property
    def accepted(self) -> int:
        return sum(getattr(c, "calls", 0) for c in self.candidates)


def _declining(arrival: Arrival):
    return None
