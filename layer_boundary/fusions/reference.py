"""A reference fusion provider written with torch ops, so ordering, fallback and the
finalize handoff are exercised on CPU. A GPU provider implements the same protocol."""

from __future__ import annotations

from collections import Counter

import torch

from ..contracts import ProducerReduction, StageKind
from ..layout import RowMode, SumGroup
from ..ops import ALL_REDUCE_TP_SLICE_DP, SLICE_DP
from ..residual import is_plain
from ..residual.add_norm import accumulate_dtype
from . import Arrival, Declined, FusedInput, InputPlan
from .terminal import TerminalFinalizeNorm

# the owed sums it completes: the FFN output's TP sum, the MoE output's, or none (one rank)
COMPLETES = frozenset({SumGroup.TP, SumGroup.MOE_OUT, None})


def finalize_all_reduce_add_norm(arrival: Arrival):
    """finalize (if a handoff) + all-reduce over TP + this DP rank's slice + fp32 add + norm,
    as one step, for a value on the global rows and a residual on this DP rank's rows. The
    norm is the module's own ``normalize_fp32``, so any weight dtype and form computes as
    the unfused read does."""
    refusal = plain_add_refusal(arrival) or (
        None if hasattr(arrival.norm, "normalize_fp32")
        else f"the norm ({type(arrival.norm).__name__}) has no normalize_fp32")
    if refusal is not None:
        return Declined(refusal)  # before touching anything: it applies the update as an add
    value = arrival.value
    if not isinstance(value, torch.Tensor):
        value = value.complete()
    facts = arrival.facts
    move = ALL_REDUCE_TP_SLICE_DP if arrival.owed is not None else SLICE_DP
    value = move.move(facts, value)
    acc = accumulate_dtype(arrival.residual.dtype)
    total = arrival.residual.to(acc) + value.to(acc)
    dtype = arrival.residual.dtype
    return arrival.norm.normalize_fp32(total, dtype), total.to(dtype)


def plain_add_refusal(arrival: Arrival) -> str | None:
    """Why a candidate that applies the update as a plain add to the residual cannot take
    ``arrival`` (None: it can)."""
    if arrival.residual is None:
        return "no residual yet (the stack's first input)"
    if not is_plain(arrival.update):
        return f"the update ({type(arrival.update).__name__}) is not a plain add"
    return None


class Counted:
    """A candidate's run that counts the arrivals it accepted (``calls``) and, by reason, the
    ones it declined (``declined``), for tests and run reports."""

    def __init__(self, run) -> None:
        self.run, self.calls = run, 0
        self.declined: Counter = Counter()

    def __call__(self, arrival: Arrival):
        out = self.run(arrival)
        if out:
            self.calls += 1
        else:
            self.declined[out.reason if isinstance(out, Declined) else "declined"] += 1
        return out


def fused_finalize_all_reduce_add_norm(plan: InputPlan, run=None) -> FusedInput:
    """The reference candidate: from the global rows onto this DP rank's rows by all-reduce."""
    layouts = plan.layouts
    return FusedInput(run=run or Counted(finalize_all_reduce_add_norm), completes=COMPLETES,
                      source=layouts.replicated, target=layouts.local, finalizes=True,
                      collective=RowMode.AR)


class ReferenceFusions:
    """Offers the fused candidate to FFN and attention inputs.

    ``defer_finalize``: let sparse FFNs hand their finalize to the next input;
    ``terminal_finalize``: also at the last layer, to the final norm's ``handoff_norm()``
    service (``fusions.terminal``);
    ``defer_all_reduce``: let a LOCAL_TAIL FFN leave its all-reduce to the next input.
    ``decline``: offer candidates that always decline (to test the fallback).
    """

    def __init__(self, defer_finalize: bool = True, terminal_finalize: bool = False,
                 defer_all_reduce: bool = False, decline: bool = False) -> None:
        self.defer_finalize, self.terminal_finalize = defer_finalize, terminal_finalize
        self.defer_all_reduce, self.decline = defer_all_reduce, decline
        self.offered: list[tuple[str, FusedInput]] = []  # (stage, candidate), as offered
        self.not_offered: dict[str, str] = {}  # stage -> why it was offered nothing
        self.service: TerminalFinalizeNorm | None = None  # once handoff_norm() made it
        self._parallel = None  # the topology of the plans it was offered to

    def _input(self, plan: InputPlan) -> list[FusedInput]:
        self._parallel = plan.parallel
        candidate = fused_finalize_all_reduce_add_norm(
            plan, Counted(_declining) if self.decline else None)
        self.offered.append((plan.stage, candidate))
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

    def handoff_norm(self, eps: float | None = 1e-6):
        """The terminal service for a final norm of epsilon ``eps`` (None: this provider
        leaves no finalize to the final norm), once its stages are built with it."""
        if self.decline or not self.terminal_finalize:
            return None
        if self._parallel is None:
            raise RuntimeError("handoff_norm() needs the provider installed first (on the "
                               "stages' construction or by install_fusion): its service sums "
                               "over their TP group")
        self.service = TerminalFinalizeNorm(self._parallel.tp_group, eps)
        return self.service

    @property
    def candidates(self) -> list[FusedInput]:
        """Every candidate offered, in the order offered."""
        return [c for _, c in self.offered]

    @property
    def accepted(self) -> int:
        return sum(c.run.calls for _, c in self.offered)

    @property
    def fused_stages(self) -> list[str]:
        """The stages whose input a candidate completed at least once, in build order."""
        return list(dict.fromkeys(name for name, c in self.offered if c.run.calls))

    def outcomes(self) -> dict[str, dict]:
        """Each stage it was asked about, in build order: ``{"offered": candidates,
        "applied": inputs completed, "declined": {reason: times}}`` (counted since it was
        installed; "offered" 0 with ``not_offered``: why it offered nothing there)."""
        out: dict[str, dict] = {}
        for stage, why in self.not_offered.items():
            out[stage] = {"offered": 0, "applied": 0, "declined": {}, "not_offered": why}
        for stage, candidate in self.offered:
            slot = out.setdefault(stage, {"offered": 0, "applied": 0, "declined": {}})
            slot.pop("not_offered", None)
            slot["offered"] += 1
            slot["applied"] += candidate.run.calls
            for reason, times in candidate.run.declined.items():
                slot["declined"][reason] = slot["declined"].get(reason, 0) + times
        return out


DECLINES = "the decline provider declines every candidate"


def _declining(arrival: Arrival):
    return Declined(DECLINES)
