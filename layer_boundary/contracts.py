"""Resolved input/output contracts, edge declarations and the producer reduction contracts.

A ``StageDeclaration`` (factories.py) says what a stage's compute does; construction resolves
it against a topology, a batch variant and a row mode into a ``StageDecl``: one
``StageInput`` and one ``StageOutput``. Path selection reads only these: a producer's exit
takes a handoff its ``StageOutput.leaves_for_*`` permits, and a consumer binds a movement
(ops.TRANSITIONS) for every arrival its producer's contract can leave.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from .layout import Layout, SumGroup
from .runtime.forward_batch import BatchVariant

__all__ = ["BatchVariant", "ProducerReduction", "StageKind", "Owed", "PathKey", "StageInput",
           "StageOutput", "StageDecl", "EdgeDecl", "UnsupportedBoundary"]


class UnsupportedBoundary(ValueError):
    """A transition this package has no correct implementation for."""


class ProducerReduction(enum.Enum):
    """How a producer's compute cooperates with the boundary's reduction decision."""

    PARTIAL = "PARTIAL"  # always returns an unreduced contribution; publishes with finish()
    SCOPED = "SCOPED"  # obeys the exit's decision; publishes through exit()
    LOCAL_TAIL = "LOCAL_TAIL"  # adds a replicated tail after its own sum; never deferred


class StageKind(enum.Enum):
    """What a stage is: an attention (or another token mixer) or an FFN (dense or MoE)."""

    ATTN = "attention"
    FFN = "ffn"


class PathKey(NamedTuple):
    """What a forward's placement selects a stage's path by: its batch variant and row mode,
    as their plain values (a forward hashes it on every stage)."""

    variant: str
    mode: str


@dataclass(frozen=True)
class Owed:
    """Work a specific output still requires: a sum over ``group`` of its ``rows``.

    Where the sum lands (all-reduce onto local rows, reduce-scatter onto scattered ones) is
    the consumer's choice for the forward's row mode, not the producer's.
    """

    group: SumGroup
    rows: Layout

    def __str__(self) -> str:
        return f"sum over {self.group.value} of {self.rows} rows"


@dataclass(frozen=True)
class StageInput:
    """What a consumer reads: its compute rows, the sum its producer always leaves (what a
    pipeline receiver re-declares), and the token axes its own input path gathers (after an
    attention's latent hook)."""

    rows: Layout
    static_owed: SumGroup | None
    gathers_itself: frozenset = frozenset()


@dataclass(frozen=True)
class StageOutput:
    """What a producer leaves, and which handoffs it was permitted at construction.

    ``leaves_for_all_reduce``: compute may skip its sum for the consumer's all-reduce (the
    ``fuse_mlp_allreduce`` flag); ``leaves_for_reduce_scatter``: for the consumer's
    reduce-scatter (an FFN's ``mlp_reduce_scatter``). A PARTIAL output always leaves its sum.
    ``hands_off_finalize``: a fusion provider may accept, per batch, a finalize handoff (any
    FFN with a provider: the provider answers, compute decides whether it has one to return);
    ``provider_defers_all_reduce``: a provider may let a LOCAL_TAIL sum defer, per batch.
    """

    kind: StageKind
    rows: Layout  # compute's output rows
    reduction: ProducerReduction
    sum_group: SumGroup | None  # None: compute needs no sum (size-1 group)
    handoff_rows: Layout  # where a complete output is handed on
    leaves_for_all_reduce: bool = False
    leaves_for_reduce_scatter: bool = False
    hands_off_finalize: bool = False
    provider_defers_all_reduce: bool = False
    at_producer: bool = False  # the update is applied at this exit; nothing pending leaves
    next_sparse: bool | None = None  # the declared sparsity of the FFN after the consumer
    # sequence-parallel compute: its linears' sum group and the rows they compute on (they
    # gather from and reduce-scatter onto ``rows``, the scattered rows); None otherwise
    linears_sum: SumGroup | None = None
    linears_rows: Layout | None = None
    # a MoE that dispatched its routed tokens and combined them back itself (all-to-all)
    dispatches: bool = False
    terminal: bool = False  # the stack's last stage: a sum it leaves, the final norm completes


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
