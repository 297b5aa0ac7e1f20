"""Fusion providers: backend completions a stage may try before its built-in input path.

A provider is passed per stage as the ``fusions`` option; give a layer's attention and FFN
stages the same one. At construction the boundary asks it for ordered input candidates
(``attention_input(plan)`` / ``ffn_input(plan)``); on every exit of an FFN that has one it asks
the batch-dependent deferral questions (``can_defer_finalize``, ``can_defer_all_reduce``).

A candidate is a ``FusedInput``: it declares what it completes (the sum groups, whether it
also finalizes a handoff, the rows it takes the value from and leaves the residual on, the
collective it fuses) and which update and read it stands in for. The consumer offers it only
to the arrivals it applies to, decided at construction: a nonlinear update, a custom read,
rows it does not move or a reduce-scatter it does not perform never reach it.

``run(arrival)`` returns ``(compute_input, residual)`` on the stage's update rows, or None to
decline (or a ``Declined`` saying why, which a run's report shows); it must decline before it
modifies any input or starts a collective, so the built-in path can still run. A candidate
whose result would differ from the consumer's own read declines: a norm weight of another
dtype than the stream's where the norm's output dtype follows the weight, a norm it does not
compute as the module does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable
from collections.abc import Callable, Sequence

from ..contracts import StageKind
from ..layout import Layout, Layouts, RowMode, SumGroup
from ..residual import ReadKind


@dataclass(frozen=True)
class InputPlan:
    """What a provider sees of one stage's input path (one batch variant and row mode)."""

    stage: str
    kind: StageKind
    mode: RowMode
    layouts: Layouts  # the topology's named layouts
    update_rows: Layout  # where the residual update and read run (the residual's layout)
    compute_rows: Layout  # where compute consumes its input
    parallel: object
    # the consumer's movement table in this variant and mode (``ops.MovementTable``): how
    # an arrival owing a sum on some rows is completed onto ``update_rows`` by the built-in
    # path, for a provider that runs the same movement before its kernel (None: not given)
    moves: object = None
    read: object = None  # the consumer's read (its ``kind``, a quantized read's ``group``)


@dataclass(frozen=True)
class Arrival:
    """One pending contribution as a consumer's input sees it; read-only for candidates."""

    value: object  # tensor or HandoffOutput
    owed: SumGroup | None
    rows: Layout
    update: object  # StageUpdate
    residual: object  # tensor | None
    residual_rows: Layout | None
    norm: object
    facts: object  # the forward's row facts (row_facts.RowFacts)


@dataclass(frozen=True)
class Declined:
    """A candidate's refusal of one arrival and why: false, as None is, for the consumer."""

    reason: str

    def __bool__(self) -> bool:
        return False


@dataclass(frozen=True, eq=False)
class FusedInput:
    """A provider's completion of an arrival fused with the update and the read."""

    run: Callable[[Arrival], tuple | None]
    completes: frozenset  # the owed sums it performs (None: takes a complete value)
    source: Layout  # the rows the arriving value is on
    target: Layout  # the rows it leaves the residual on
    finalizes: bool = False  # also takes a HandoffOutput
    collective: RowMode = RowMode.AR  # the transport it fuses (all-reduce kernels: AR)
    read: ReadKind = ReadKind.ADD_NORM  # the read kind it stands in for
    # It applies the update as a plain add: a nonlinear update never reaches it.

    def applies(self, owed, source: Layout, handoff: bool, target: Layout, mode: RowMode,
                update_plain: bool, read_kind: ReadKind | None) -> bool:
        return (owed in self.completes and source == self.source and target == self.target
                and (self.finalizes or not handoff) and mode is self.collective
                and update_plain and read_kind == self.read)


# The spec's name for the FFN-input candidate.
FusedMlpInput = FusedInput


@runtime_checkable
class FusionProvider(Protocol):
    def attention_input(self, plan: InputPlan) -> Sequence[FusedInput]: ...

    def ffn_input(self, plan: InputPlan) -> Sequence[FusedInput]: ...

    def can_defer_finalize(self, plan, forward_batch) -> bool: ...

    def can_defer_all_reduce(self, plan, forward_batch) -> bool: ...

    # Optional: ``handoff_norm(eps)`` returns a service whose ``finalize(handoff, residual,
    # gamma)`` completes a terminal finalize handoff with the TP sum, the residual add and
    # the final norm (``gamma``: its ``gemma_weight``) in one call, or None to decline, for
    # ``residual_batch.norm(..., handoff_norm=service)`` (fusions/terminal.py).
