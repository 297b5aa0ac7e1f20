"""Resolved input/output contracts, edge declarations and the producer reduction contracts."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .layout import Layout, Rows, SumGroup
from .runtime.forward_batch import BatchVariant

__all__ = ["BatchVariant", "ProducerReduction", "StageKind", "Owed", "StageInput",
           "StageOutput", "StageDecl", "EdgeDecl"]


class ProducerReduction(enum.Enum):
    """How a producer's compute cooperates with the boundary's reduction decision."""

    PARTIAL = "PARTIAL"  # always returns an unreduced contribution; publishes with finish()
    SCOPED = "SCOPED"  # obeys the exit's decision; publishes through exit()
    LOCAL_TAIL = "LOCAL_TAIL"  # adds a replicated tail after its own sum; never deferred


class StageKind(enum.Enum):
    ATTN = "attention"
    FFN = "ffn"


@dataclass(frozen=True)
class Owed:
    """Work a specific output still requires: a sum over ``group`` of its ``rows``.

    Where the sum lands (all-reduce onto local rows, reduce-scatter onto scattered ones) is
    the consumer's choice for the forward's row mode, not the producer's.
    """

    group: SumGroup
    rows: Rows

    def __str__(self) -> str:
        return f"sum over {self.group.value} of {self.rows.value} rows"


@dataclass(frozen=True)
class StageInput:
    """What a consumer reads: its compute rows and the sum its producer statically owes."""

    rows: Layout
    static_owed: Owed | None


@dataclass(frozen=True)
class StageOutput:
    """What a producer leaves, and which handoffs it was permitted at construction."""

    rows: Layout
    reduction: ProducerReduction
    sum_group: SumGroup | None  # None: compute needs no sum (size-1 group)
    leaves_for_all_reduce: bool = False  # may leave its sum to the consumer's all-reduce
    leaves_for_reduce_scatter: bool = False  # may leave its sum to a reduce-scatter


@dataclass(frozen=True)
class StageDecl:
    """One stage after topology and batch variant have been applied."""

    variant: BatchVariant
    input: StageInput
    output: StageOutput


@dataclass(frozen=True)
class EdgeDecl:
    """A producer output meeting a consumer input, with the residual's rows on both sides."""

    producer: StageOutput | None  # None at stack entry
    consumer: StageInput
    residual_src: Layout
    residual_dst: Layout
