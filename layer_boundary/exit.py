"""Output completion decisions and the scoped compute flags that carry them.

A decision is made once per exit: its flags tell compute which reduction to skip, and what it
records tells the next boundary exactly what it owes. Decisions are built at construction
from the producer's ``StageOutput``; an exit only selects one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .layout import Layout, SumGroup
from .ops import Movement
from .output import HandoffOutput
from .residual.access import start_completion
from .residual.batch import fold_stream
from .residual.stream import Contribution, OwedOutput, arrival_key
from .runtime.context import FORWARD_STATE, ForwardFlags, SequenceParallelScope
from .runtime.ledger import HOOK, active_observer


@dataclass(frozen=True)
class ExitDecision:
    flags: ForwardFlags
    owed: SumGroup | None  # what the consumer must still finish
    rows: Layout  # where compute's output rows are
    label: str
    hands_off: bool = False  # compute may return a HandoffOutput
    declared: bool = False  # the owed sum is the producer's static contract
    # a complete output moves to the rows the layer hands on at finish()
    finish_move: Movement | None = None
    # the sum compute runs itself when it completes its output (for plans and ledgers)
    compute_sum: Movement | None = None

    # the Contribution key of a plain (non-handoff) output left by this decision
    key: tuple = field(init=False, repr=False, compare=False)

    # what a plain (non-handoff) output leaves pending: (owed, its rows, declared)
    leaves: tuple = field(init=False, repr=False, compare=False)
    # finish() moves no rows: the output stays on the rows compute left it on
    leaves_as_is: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        moved = self.finish_move
        leaves = ((None, moved.dst, False) if moved is not None
                  else (self.owed, self.rows, self.declared))
        object.__setattr__(self, "leaves", leaves)
        object.__setattr__(self, "key", arrival_key(leaves[0], leaves[1], False))
        object.__setattr__(self, "leaves_as_is", moved is None or not moved.moves)

    def arrivals(self) -> tuple[tuple, ...]:
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


def check_output_dtype(stream, value, stage: str) -> None:
    """A stage's output in the residual's dtype (a silent promotion or downcast would change
    every later number)."""
    residual = stream.residual
    if (isinstance(value, torch.Tensor) and residual is not None
            and value.dtype != residual.dtype):
        raise TypeError(f"stage {stage} returned a {value.dtype} output; the residual stream "
                        f"holds {residual.dtype}")


def publish(stream, path: ExitPath, decision: ExitDecision, value, update, rows,
            overlap: bool = False, transform=None):
    """Record compute's output with ``decision``'s owed work (one of ``path``'s); return what
    the model passes on. ``overlap`` (a two-batch-overlap microbatch): on a path that issues
    early, owed work starts now, asynchronously. ``transform``: an ``OutputTransform`` the
    stage declared ``before_reduce_scatter``, applied to the output as compute returned it."""
    if transform is not None:
        value = transform(value)
    moved = decision.finish_move
    if moved is None and isinstance(value, HandoffOutput):  # under its own key (computed)
        stream.leave(value, decision.owed, update, decision.rows, True, decision.declared)
    else:
        if moved is not None and moved.moves:
            value = moved.run(rows, value)
        owed, where, declared = decision.leaves
        stream.leave(value, owed, update, where, False, declared, decision.key)
    if path.at_producer:
        return fold_stream(stream, rows)
    c = stream.contribution
    if overlap and path.issues_early and (c.owed is not None or c.handoff):
        start_completion(stream, rows)
    return stream.handle


# an exit's states, compared by identity
NEW, OPEN, COMPUTED, FAILED, FINISHED = "new", "open", "computed", "failed", "finished"
_FINISH_MISUSE = {FAILED: "finish() called after the exit's computation raised",
                  NEW: "finish() called before the exit scope was entered",
                  FINISHED: "finish() called twice on one exit"}


class StageExit:
    """Scope around an FFN's or mixer's compute: publishes the decision's flags, restores them.

    Opening it takes the stage's turn: a second exit() of the same prepare() raises.
    """

    __slots__ = ("_stream", "_lane", "_forward_batch", "_rows", "_decision", "_previous",
                 "_state", "_adapter_rows")

    def __init__(self, stream, lane, forward_batch, rows, adapter_rows=None) -> None:
        """``lane``: the stage's lane of the selected path (``lane.Lane``: its stage, exit
        path and plain decisions); ``rows``: the forward's row facts; ``adapter_rows``:
        published for the LoRA linears inside the scope. (``StageBoundary.exit`` sets the
        same slots itself on its plain path.)"""
        self._stream, self._lane, self._forward_batch = stream, lane, forward_batch
        self._rows, self._adapter_rows = rows, adapter_rows
        self._decision = self._previous = None
        self._state = NEW
        stream.handle = self

    def __enter__(self):
        if self._state is not NEW:
            raise RuntimeError("an exit scope can be entered once")
        path = self._lane.exit
        self._decision = decision = (path.select(self._forward_batch) if path.choices
                                     else path.default)
        flags = decision.flags
        state = FORWARD_STATE
        self._previous = state.scope
        state.scope = (flags, None if flags.sequence_parallel is None else SequenceParallelScope(
            flags.sequence_parallel, self._forward_batch.rows), self._adapter_rows)
        state.open_scopes += 1
        if HOOK.observer is not None:
            observer = active_observer()
            if observer is not None:
                observer.enter(self._lane.stage._compute_site)
        self._state = OPEN
        return self

    def __exit__(self, exc_type, exc, tb):
        state = FORWARD_STATE
        state.scope = self._previous
        state.open_scopes -= 1
        self._state = COMPUTED if exc_type is None else FAILED
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
        stream = self._stream
        if (self._state is COMPUTED and stream.handle is self and HOOK.observer is None
                and type(hidden_states) is torch.Tensor and not self._forward_batch.overlap):
            decision, lane, residual = self._decision, self._lane, stream.residual
            if decision in lane.plain and (residual is None
                                           or hidden_states.dtype == residual.dtype):
                # ``publish`` (and ``stream.leave``) of a plain tensor that stays where
                # compute left it, with nobody watching, written out: every stage of an
                # ordinary forward comes here
                self._state = FINISHED
                owed, where, declared = decision.leaves
                stream.contribution = Contribution(hidden_states, owed, lane.update, where,
                                                   False, declared, False, decision.key)
                handle = stream.handle = hidden_states if owed is None else OwedOutput(stream)
                return handle
        misuse = _FINISH_MISUSE.get(self._state)
        if misuse is not None:
            raise RuntimeError(misuse)
        if stream.handle is not self:
            raise RuntimeError("finish() on an exit whose stream has moved on")
        stage = self._lane.stage
        residual = stream.residual
        if type(hidden_states) is not torch.Tensor or (
                residual is not None and hidden_states.dtype != residual.dtype):
            # anything but a plain tensor of the residual's dtype: name what is wrong
            if isinstance(hidden_states, HandoffOutput) and not self.defer_moe_finalize:
                raise RuntimeError("compute returned a HandoffOutput, but this exit did not "
                                   "publish defer_moe_finalize")
            check_output_dtype(stream, hidden_states, stage.name)
        self._state = FINISHED
        rows = self._rows
        observer = active_observer()
        if observer is not None:
            observer.enter(stage._finish_site)
        handle = publish(stream, self._lane.exit, self._decision, hidden_states, stage._update,
                         rows, self._forward_batch.overlap, stage._transform)
        if observer is not None:
            observer.boundary(stage._finish_site, stream, rows)
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
