"""Output completion decisions and the scoped compute flags that carry them.

A decision is made once per exit: its flags tell compute which reduction to skip, and what it
records tells the next boundary exactly what it owes. Decisions are built at construction
from the producer's ``StageOutput``; an exit only selects one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple
from collections.abc import Callable

from .layout import Layout, SumGroup
from .ops import Movement
from .residual.stream import ArrivalKey, arrival_key
from .runtime.context import ForwardFlags, close_scope, open_scope
from .runtime.ledger import HOOK, active_observer


class Leaves(NamedTuple):
    """What an output leaves the next boundary: the sum it still owes (None: complete), the
    rows it is on, and whether that sum is the producer's static contract."""

    owed: SumGroup | None
    rows: Layout
    declared: bool


@dataclass(frozen=True, slots=True)
class ExitDecision:
    """One way an exit may complete its output: the flags compute sees, what the next
    boundary still owes and on which rows. (What a plain publish reads comes first.)"""

    # what a plain (non-handoff) output leaves pending: what it owes, on which rows, and
    # whether that is the producer's declared sum, and the arrival key of such an output
    leaves: Leaves = field(init=False, repr=False, compare=False)
    key: ArrivalKey = field(init=False, repr=False, compare=False)
    hands_off: bool = field(default=False, kw_only=True)  # compute may return a HandoffOutput
    # finish() moves its rows (a finish_move that is not the identity)
    moves_at_finish: bool = field(init=False, repr=False, compare=False)
    flags: ForwardFlags
    owed: SumGroup | None  # what the consumer must still finish
    rows: Layout  # where compute's output rows are
    label: str
    declared: bool = False  # the owed sum is the producer's static contract
    # a complete output moves to the rows the layer hands on at finish()
    finish_move: Movement | None = None
    # the sum compute runs itself when it completes its output (for plans and ledgers)
    compute_sum: Movement | None = None

    def __post_init__(self) -> None:
        moved = self.finish_move
        leaves = (Leaves(None, moved.dst, False) if moved is not None
                  else Leaves(self.owed, self.rows, self.declared))
        object.__setattr__(self, "leaves", leaves)
        object.__setattr__(self, "key", arrival_key(leaves.owed, leaves.rows, False))
        object.__setattr__(self, "moves_at_finish", moved is not None and moved.moves)

    def arrivals(self) -> tuple[ArrivalKey, ...]:
        """The Contribution keys an output of this decision arrives with."""
        if self.finish_move is not None:
            return (self.key,)
        plain = self.key
        if not self.hands_off:
            return (plain,)
        return (plain, arrival_key(self.owed, self.rows, True))


@dataclass(frozen=True)
class OutputPlan:
    """What a fusion provider sees of one stage's output path."""

    stage: str
    declaration: object
    mode: object


@dataclass(frozen=True)
class ExitPath:
    """The decisions one stage's output may take in one batch variant and row mode.

    ``choices`` (built at construction when a fusion provider is present) are the provider's
    questions in the order they are asked, each with the decision a yes selects; the first
    yes wins, and ``default`` stands when every question is answered no.
    """

    default: ExitDecision
    choices: tuple[tuple[Callable, ExitDecision], ...] = ()
    at_producer: bool = False  # fold the update in at finish(); nothing pending leaves
    # an output compute already completed (no exit scope, so no flags): handed on on the
    # handoff rows, nothing owed (the operation-scheduled FFN's postprocess())
    completed: ExitDecision | None = None
    # a two-batch-overlap microbatch issues an owed sum at finish(), asynchronously; not
    # where a fusion provider is present: its candidates complete the sum at the next input
    # (and a finalize handoff stays one), as they do without the overlap
    issues_early: bool = True

    @property
    def decisions(self) -> tuple[ExitDecision, ...]:
        return (self.default, *(decision for _, decision in self.choices))

    def select(self, forward_batch) -> ExitDecision:
        for ask, decision in self.choices:
            if ask(forward_batch):
                return decision
        return self.default


class ExitState(enum.Enum):
    """Where an exit object is in its one use."""

    NEW = "new"  # made by exit(): holds the stage's turn, its scope not entered yet
    OPEN = "open"  # compute runs inside its scope
    COMPUTED = "computed"  # the scope closed normally: finish() next
    FAILED = "failed"  # compute raised inside the scope
    FINISHED = "finished"  # finish() published the output


_FINISH_MISUSE = {ExitState.FAILED: "finish() called after the exit's computation raised",
                  ExitState.NEW: "finish() called before the exit scope was entered",
                  ExitState.FINISHED: "finish() called twice on one exit"}


class StageExit:
    """Scope around an FFN's or mixer's compute: publishes the decision's flags, restores them.

    Opening it takes the stage's turn: a second exit() of the same prepare() raises. The
    decision and the publishing are the stage's bound step's (``step.StageStep``); this
    object only holds the turn between the scope and ``finish()``.
    """

    __slots__ = ("_stream", "_step", "_forward_batch", "_facts", "_decision", "_previous",
                 "_state", "_adapter_rows")

    def __init__(self, stream, step, forward_batch, facts, adapter_rows) -> None:
        """``step``: the stage's bound step of the selected path; ``facts``: the forward's
        row facts; ``adapter_rows``: published for the LoRA linears inside the scope."""
        self._stream, self._step, self._forward_batch = stream, step, forward_batch
        self._facts, self._adapter_rows = facts, adapter_rows
        self._decision = self._previous = None
        self._state = ExitState.NEW
        stream.hold(self)

    def __enter__(self):
        if self._state is not ExitState.NEW:
            raise RuntimeError("an exit scope can be entered once")
        step = self._step
        self._decision = decision = step.decide(self._forward_batch)
        self._previous = open_scope(step.scope_of(decision, self._facts, self._adapter_rows))
        observer = active_observer() if HOOK.observer is not None else None
        if observer is not None:
            observer.enter(step.stage.sites.compute)
        self._state = ExitState.OPEN
        return self

    def __exit__(self, exc_type, exc, tb):
        close_scope(self._previous)
        self._state = ExitState.COMPUTED if exc_type is None else ExitState.FAILED
        return False

    @property
    def decision(self) -> ExitDecision:
        if self._decision is None:
            raise RuntimeError("the exit decision is made when its scope is entered")
        return self._decision

    @property
    def fuse_mlp_allreduce(self) -> bool:
        return self.decision.flags.fuse_mlp_allreduce

    @property
    def mlp_reduce_scatter(self) -> bool:
        return self.decision.flags.mlp_reduce_scatter

    @property
    def defer_moe_finalize(self) -> bool:
        return self.decision.flags.defer_moe_finalize

    @property
    def skips_reduction(self) -> bool:
        return self.decision.flags.skips_reduction

    def finish(self, hidden_states):
        """Record compute's output with the decided owed work; return what to pass on."""
        misuse = _FINISH_MISUSE.get(self._state)
        if misuse is not None:
            raise RuntimeError(misuse)
        stream = self._stream
        if stream.handle is not self:
            raise RuntimeError("finish() on an exit whose stream has moved on")
        handle = self._step.publish(stream, hidden_states, self._decision, self._facts,
                                    self._forward_batch)
        self._state = ExitState.FINISHED
        return handle


class FfnExit(StageExit):
    """Exit of an FFN: publishes fuse_mlp_allreduce, mlp_reduce_scatter, defer_moe_finalize."""

    __slots__ = ()


class MixerExit(StageExit):
    """Exit of a single-stage mixer: publishes fuse_mlp_allreduce, exposed as skips_reduction."""

    __slots__ = ()


class AttnExit(StageExit):
    """Exit of a PARTIAL attention: publishes no flag (its sum is always owed), except in a
    sequence-parallel batch, where the scope's movements let its linears gather and
    reduce-scatter and the output is complete."""

    __slots__ = ()
