"""Fusion providers: backend completions a stage may try before its built-in input path.

A provider is passed per stage as the ``fusions`` option; give a layer's attention and FFN
stages the same one. The boundary calls it at construction for ordered input candidates, and
on every exit of an FFN that has one for the batch-dependent deferral decisions.

A candidate is called as ``candidate(arrival)`` with an ``Arrival`` and returns
``(compute_input, residual)`` on the stage's update rows, or None. It must return None before
it modifies any input or starts a collective, so the built-in path can still run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

from ..layout import BatchRows, Rows


@dataclass(frozen=True)
class InputPlan:
    """What a provider sees of one stage's input path (one batch variant and row mode)."""

    stage: str
    kind: str  # "attention" | "ffn"
    mode: object  # RowMode
    update_rows: Rows
    compute_rows: Rows
    parallel: object


@dataclass(frozen=True)
class Arrival:
    """One pending contribution as a consumer's input sees it; read-only for candidates."""

    value: object  # tensor or HandoffOutput
    owed: object  # Owed | None
    rows: Rows
    update: object  # StageUpdate
    residual: object  # tensor | None
    residual_rows: Rows
    norm: object
    batch_rows: BatchRows


Candidate = Callable[[Arrival], "tuple | None"]


@runtime_checkable
class FusionProvider(Protocol):
    def attention_input(self, plan: InputPlan) -> Sequence[Candidate]: ...

    def ffn_input(self, plan: InputPlan) -> Sequence[Candidate]: ...

    def can_defer_finalize(self, plan, forward_batch) -> bool: ...

    def can_defer_all_reduce(self, plan, forward_batch) -> bool: ...

    # Optional: ``handoff_norm()`` returns a service whose ``finalize(arrival)`` completes a
    # terminal finalize handoff inside the final norm (or None to decline), for
    # ``residual_batch.norm(..., handoff_norm=service)``.
