"""The forward-flag scope and the current topology, as compute modules see them.

Flags are published only by a boundary's exit scope (spec: "Do not set a skip flag
independently of a completion action"); compute reads them through ``get_forward()``. A
sequence-parallel exit also opens a ``SequenceParallelScope`` (``sequence_parallel_scope()``):
the two movements its linears run, on the forward's row facts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .parallel import Parallel


@dataclass(frozen=True)
class ForwardFlags:
    fuse_mlp_allreduce: bool = False  # skip the output all-reduce; the boundary owns the sum
    mlp_reduce_scatter: bool = False  # leave the sum to the boundary's reduce-scatter
    defer_moe_finalize: bool = False  # a MoE may return a HandoffOutput
    # compute runs on scattered rows: its linears gather and reduce-scatter (the scope's
    # movements, ``sequence_parallel_scope()``); the boundary owes nothing after it
    sequence_parallel: SequenceParallelMoves | None = None

    @property
    def skips_reduction(self) -> bool:
        return self.fuse_mlp_allreduce or self.mlp_reduce_scatter


@dataclass(frozen=True)
class SequenceParallelMoves:
    """What a sequence-parallel stage's linears do with rows (the table's movements, bound at
    construction): ``gather`` brings the scattered input to the rows compute needs (inside
    the column-parallel linears), ``scatter`` sums a partial output over the linears' group
    onto the scattered rows (inside the row-parallel ones)."""

    gather: object  # ops.Movement, scattered -> compute rows
    scatter: object  # ops.Movement, partial on compute rows -> complete on scattered rows
    group: object  # the linears' group (runtime.parallel.Group)


class SequenceParallelScope:
    """One open sequence-parallel exit: its movements on this forward's row facts. The
    column-parallel linears of one compute share one gather of one input (a gate and an up
    projection read the same rows)."""

    __slots__ = ("moves", "facts", "_last")

    def __init__(self, moves: SequenceParallelMoves, facts) -> None:
        self.moves, self.facts, self._last = moves, facts, None

    def check_group(self, group, linear: str) -> None:
        if group.ranks != self.moves.group.ranks:
            raise RuntimeError(
                f"a {linear} over group {group.name} {list(group.ranks)} runs inside a "
                f"sequence-parallel scope over {self.moves.group.name} "
                f"{list(self.moves.group.ranks)}: it cannot gather or scatter these rows")

    def gather(self, x):
        last = self._last
        if last is not None and last[0] is x:
            return last[1]
        gathered = self.moves.gather.move(self.facts, x) if self.moves.gather.moves else x
        self._last = (x, gathered)
        return gathered

    def scatter(self, y):
        return self.moves.scatter.move(self.facts, y)


NO_FLAGS = ForwardFlags()


class _NoAdapters:
    """The adapter rows of a batch whose rows all run the base model (a sentinel: compared
    by identity)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NO_ADAPTERS"


NO_ADAPTERS = _NoAdapters()


class Scope(NamedTuple):
    """What compute sees inside one exit scope: its flags, its sequence-parallel movements on
    this forward's rows (None: compute's rows are not scattered), and each compute row's
    adapter slot (``NO_ADAPTERS``: none runs; None outside any exit scope, where an adapted
    linear refuses to run)."""

    flags: ForwardFlags
    sequence_parallel: SequenceParallelScope | None
    adapter_rows: object


OUTSIDE = Scope(NO_FLAGS, None, None)


class _ForwardState:
    """What compute sees now: ``scope``, the innermost open exit's ``Scope``, swapped whole
    on entry and restored on leaving (``open_scope``/``close_scope``, its only writers);
    ``open_scopes``, how many are open."""

    __slots__ = ("scope", "open_scopes")

    def __init__(self) -> None:
        self.scope: Scope = OUTSIDE
        self.open_scopes = 0  # exit scopes entered and not yet left


# the scope compute sees now; exit scopes (an exit object, ``StageBoundary.run``) open it on
# entry and close it on leaving, on every stage of every forward
FORWARD_STATE = _ForwardState()


def get_forward() -> ForwardFlags:
    """Flags of the innermost open exit scope (all False outside one)."""
    return FORWARD_STATE.scope.flags


def open_scope(scope: Scope) -> Scope:
    """Enter an exit's compute scope; returns the scope it replaces, for ``close_scope``."""
    state = FORWARD_STATE
    previous = state.scope
    state.scope = scope
    state.open_scopes += 1
    return previous


def close_scope(previous: Scope) -> None:
    """Leave an exit's compute scope, restoring what ``open_scope`` returned."""
    state = FORWARD_STATE
    state.scope = previous
    state.open_scopes -= 1


def adapter_rows():
    """The open exit's adapter slot per compute row (-1: the base model), NO_ADAPTERS, or
    None outside any exit scope."""
    return FORWARD_STATE.scope.adapter_rows


def sequence_parallel_scope() -> SequenceParallelScope | None:
    """The open sequence-parallel exit's movements (None outside one)."""
    return FORWARD_STATE.scope.sequence_parallel


def open_exit_scopes() -> int:
    """How many exit scopes are open now (a two-batch-overlap yield point requires none)."""
    return FORWARD_STATE.open_scopes


def get_parallel() -> Parallel:
    """The topology of the boundary runtime this process was set up with."""
    from .args import get_runtime

    return get_runtime().parallel
