"""Output completion decisions and the scoped compute flags that carry them.

A decision is made once per exit: its flags tell compute which reduction to skip, and what it
records tells the next boundary exactly what it owes. Decisions are built at construction
from the producer's ``StageOutput``; an exit only selects one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .layout import Layout, SumGroup
from .ops import Movement
from .output import HandoffOutput
from .residual.access import start_completion
from .residual.batch import fold_stream
from .residual.stream import arrival_key
from .runtime.context import (ForwardFlags, SequenceParallelScope, swap_adapter_rows,
                              swap_flags)
from .runtime.ledger import active_observer


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

    def arrivals(self) -> tuple[tuple, ...]:
        """The Contribution keys an output of this decision arrives with."""
        if self.finish_move is not None:
            return (arrival_key(None, self.finish_move.dst, False),)
        plain = arrival_key(self.owed, self.rows, False)
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
    if decision.finish_move is not None:
        stream.leave(decision.finish_move(rows, value), None, update, decision.finish_move.dst)
    else:
        stream.leave(value, decision.owed, update, decision.rows,
                     handoff=isinstance(value, HandoffOutput), declared=decision.declared)
    if path.at_producer:
        return fold_stream(stream, rows)
    c = stream.contribution
    if overlap and path.issues_early and (c.owed is not None or c.handoff):
        start_completion(stream, rows)
    return stream.handle


class StageExit:
    """Scope around an FFN's or mixer's compute: publishes the decision's flags, restores them.

    Opening it takes the stage's turn: a second exit() of the same prepare() raises.
    """

    __slots__ = ("_stream", "_path", "_forward_batch", "_update", "_site", "_finish_site",
                 "_decision", "_previous", "_state", "_adapter_rows", "_previous_rows",
                 "_transform")

    def __init__(self, stream, path: ExitPath, forward_batch, update, site: str,
                 finish_site: str, adapter_rows=None, transform=None) -> None:
        self._transform = transform  # a before-the-sum OutputTransform, or None
        self._stream, self._path, self._forward_batch = stream, path, forward_batch
        self._update, self._site, self._finish_site = update, site, finish_site
        self._decision: ExitDecision | None = None
        self._previous = self._previous_rows = None
        self._adapter_rows = adapter_rows  # published for the LoRA linears inside
        self._state = "new"
        stream.handle = self

    def __enter__(self):
        if self._state != "new":
            raise RuntimeError("an exit scope can be entered once")
        self._decision = self._path.select(self._forward_batch)
        flags = self._decision.flags
        scope = None if flags.sequence_parallel is None else SequenceParallelScope(
            flags.sequence_parallel, self._forward_batch.rows)
        self._previous = swap_flags(flags, True, scope)
        self._previous_rows = swap_adapter_rows(self._adapter_rows)
        observer = active_observer()
        if observer is not None:
            observer.enter(self._site)
        self._state = "open"
        return self

    def __exit__(self, exc_type, exc, tb):
        swap_flags(self._previous[0], False, self._previous[1])
        swap_adapter_rows(self._previous_rows)
        self._state = "failed" if exc_type is not None else "computed"
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
        if self._state == "failed":
            raise RuntimeError("finish() called after the exit's computation raised")
        if self._state == "new":
            raise RuntimeError("finish() called before the exit scope was entered")
        if self._state == "finished":
            raise RuntimeError("finish() called twice on one exit")
        if self._stream.handle is not self:
            raise RuntimeError("finish() on an exit whose stream has moved on")
        if isinstance(hidden_states, HandoffOutput) and not self.defer_moe_finalize:
            raise RuntimeError("compute returned a HandoffOutput, but this exit did not "
                               "publish defer_moe_finalize")
        check_output_dtype(self._stream, hidden_states, self._finish_site.rsplit(".", 1)[0])
        self._state = "finished"
        rows = self._forward_batch.rows
        observer = active_observer()
        if observer is not None:
            observer.enter(self._finish_site)
        handle = publish(self._stream, self._path, self._decision, hidden_states, self._update,
                         rows, self._forward_batch.overlap, transform=self._transform)
        if observer is not None:
            observer.boundary(self._finish_site, self._stream, rows)
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
