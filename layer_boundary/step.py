"""A stage's bound steps: one per (batch variant, row mode) path, built when the stage binds.

A step owns the only implementation of each part of a stage's turn:

- entering: its ``entry`` (``prepare.EntryPath.enter``: complete, update, read, move);
- the compute scope: which exit decision stands (``decide``; fixed at bind time where the
  exit asks nothing per batch) and what compute sees inside it (``scope_of``; prebuilt as
  ``scope`` where nothing in it depends on the forward);
- publishing: ``publish`` records compute's output with the decision's owed work. It is the
  one place a stage's output becomes the stream's ``Contribution`` (``ResidualStream.leave``).

``StageBoundary``'s model-facing methods select a step and delegate to it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import parallel_block
from .exit import ExitDecision
from .output import HandoffOutput, TransformedHandoff
from .residual.access import start_completion
from .residual.batch import fold_stream
from .runtime.context import NO_ADAPTERS, Scope, SequenceParallelScope
from .runtime.ledger import HOOK, active_observer

Tensor = torch.Tensor  # a module global: ``torch.Tensor`` is a lookup in torch's large namespace


class Sites(NamedTuple):
    """How the ledger and traces name a stage's three calls."""

    prepare: str
    compute: str
    finish: str

    @classmethod
    def of(cls, name: str) -> Sites:
        return cls(f"{name}.prepare", f"{name}.compute", f"{name}.finish")


class StageStep:
    """One stage's turn on one prebuilt path (``construction.StagePath``).

    ``fixed``: the decision every exit of this path takes (None where a fusion provider is
    asked per batch); ``scope``: what compute sees inside that decision's scope, where it
    needs nothing of the forward (no scattered rows) and no adapter runs (else None).
    """

    __slots__ = ("stage", "path", "entry", "exit", "update", "transform", "fixed", "scope",
                 "folds", "issues_early", "joins")

    def __init__(self, stage, path) -> None:
        """``stage``: the StageBoundary; ``path``: one of its plan's paths."""
        self.stage, self.path = stage, path
        self.entry, self.exit = path.entry, path.exit
        declaration = stage.declaration
        self.update = declaration.residual.update
        # an OutputTransform declared before the sum runs on compute's output as published
        # (after the sum it travels in the declaration's update instead)
        self.transform = declaration.transform_first
        out = path.exit
        # the update folds in at the producer's finish (nothing pending leaves); else a
        # two-batch-overlap microbatch may issue its owed sum then
        self.folds, self.issues_early = out.at_producer, out.issues_early
        self.joins = declaration.parallel  # the attention's partial joins this output's sum
        self.fixed = None if out.choices else out.default
        self.scope = (None if self.fixed is None or self.fixed.flags.sequence_parallel
                      is not None else Scope(self.fixed.flags, None, NO_ADAPTERS))

    def decide(self, forward_batch) -> ExitDecision:
        """The decision this exit takes for ``forward_batch``."""
        fixed = self.fixed
        return fixed if fixed is not None else self.exit.select(forward_batch)

    @staticmethod
    def scope_of(decision: ExitDecision, facts, adapter_rows) -> Scope:
        """What compute sees inside ``decision``'s scope: its flags, the sequence-parallel
        movements on this forward's rows (or None), each compute row's adapter slot."""
        flags = decision.flags
        moves = flags.sequence_parallel
        return Scope(flags, None if moves is None else SequenceParallelScope(moves, facts),
                     adapter_rows)

    def check_output(self, stream, value, decision: ExitDecision) -> None:
        """What compute returned, refused by name where it cannot be published (before
        anything changes): a handoff where the exit did not allow one, a dtype other than
        the residual's."""
        residual = stream.residual
        if type(value) is torch.Tensor and (residual is None or value.dtype is residual.dtype):
            return
        name = self.stage.name
        if isinstance(value, HandoffOutput):
            if not decision.hands_off:
                raise RuntimeError("compute returned a HandoffOutput, but this exit did not "
                                   "publish defer_moe_finalize")
            return
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"stage {name} returned a {type(value).__name__}, not its output "
                            "tensor")
        if residual is not None and value.dtype != residual.dtype:
            raise TypeError(f"stage {name} returned a {value.dtype} output; the residual stream "
                            f"holds {residual.dtype}")

    def publish(self, stream, value, decision: ExitDecision, facts, forward_batch):
        """Record compute's output with ``decision``'s owed work; return what the model
        passes on.

        Args:
            stream: the forward's residual stream (the stage's turn).
            value: compute's output (a tensor, or a ``HandoffOutput`` where the decision
                hands off its finalize).
            decision: one of this step's exit decisions.
            facts: the forward's row facts.
            forward_batch: the forward (a two-batch-overlap microbatch issues owed sums now,
                asynchronously, where the exit allows it).
        """
        residual = stream.residual
        if type(value) is not Tensor or (residual is not None
                                         and value.dtype is not residual.dtype):
            self.check_output(stream, value, decision)
        observer = HOOK.observer
        if observer is not None:
            observer = active_observer()
            if observer is not None:
                observer.enter(self.stage.sites.finish)
        if self.transform is not None:
            value = (TransformedHandoff(value, self.transform)
                     if isinstance(value, HandoffOutput) else self.transform(value))
        if self.joins:
            value = parallel_block.join(stream, value, decision, facts)
        if decision.hands_off and isinstance(value, HandoffOutput):  # under its own key
            handle = stream.leave(value, decision.owed, self.update, decision.rows, True,
                                  decision.declared)
        else:
            if decision.moves_at_finish:
                value = decision.finish_move.move(facts, value)
            leaves = decision.leaves
            handle = stream.leave(value, leaves.owed, self.update, leaves.rows, False,
                                  leaves.declared, decision.key)
        if self.folds:
            handle = fold_stream(stream, facts, forward_batch)
        elif self.issues_early and not forward_batch.boundary.plain and forward_batch.overlap:
            c = stream.contribution
            if c.owed is not None or c.handoff:
                start_completion(stream, facts)
                handle = stream.handle
        if observer is not None:
            observer.boundary(self.stage.sites.finish, stream, facts)
        return handle
