"""The layer stack: one model's stages in build order, with their neighbours and branches.

A model builds its stages inside a stack::

    with layer_stack(runtime) as stack:
        layers = [DecoderLayer(cfg, i) for i in range(n)]   # each appends its stages
    receiver = stack.first                                 # a pipeline rank's first stage

The stack owns what a stage cannot know alone: the order stages were built in (so the stage
before one is its producer), the branch prepared from a source stage, and the first and last
stage of this pipeline rank's part of the model. Nothing outside the stack remembers them, so
two models build their stacks interleaved on one runtime (a target and its draft) without
seeing each other.

Under pipeline parallelism each rank builds its own part of the model's stack, and its
neighbours there live on other ranks: the stack on a later rank is opened with
``previous=`` (the declaration of the last stage of the rank before), the stack on an earlier
rank with ``following=`` (the first stage of the rank after). A model derives both from the
same per-layer declaration function its layers append with, so both ranks describe the cut
alike. A stack on such a runtime that would start or end the model's stack mid-pipeline is
refused by name.

Stages join a stack two ways:

- ``append_stages(*items, prepared_from=None, name=None)`` (or ``stack.append``): the stack
  supplies each stage's ``previous`` (the stage appended before it on the stack's main line,
  or the stack's own ``previous``) and ``following`` (the next one appended, or the stack's
  own ``following``; the main line's last stage is terminal when the stack ends without
  one). A stage binds its plan once both neighbours are known: at the next append, or when
  the stack closes. A branch (``prepared_from``: a stage on this stack) reads its source's
  prepared input, and the model merges its output back into the source's pending output
  (``merge_branch``) before the main line goes on: its stages bind with each other, and its
  last stage's consumer is the main line's next stage, as the source's is.
- ``make_stages(...)`` with explicit ``previous``/``following``/``terminal`` binds at once; inside
  an open stack its stages join it and are checked against the stages built next to them.

The open stack is a construction scope (a context variable, like the forward-flag scope):
``append_stages`` and ``make_stages`` find it there, and it is gone when the ``with`` ends.
Neighbours are compared by what their stages do (``StageDeclaration.facts``), never by the
identity of per-layer objects.
"""

from __future__ import annotations

import contextlib
import dataclasses

from .construction import UnsupportedBoundary
from .contracts import ProducerReduction, StageKind
from .factories import (StageDeclaration, building_into, check_items, check_next_sparse,
                        fact_differences, link_branch, open_stack, stage_names)
from .residual import is_portable
from .runtime.args import get_runtime
from .stage import StageBoundary

__all__ = ["LayerStack", "layer_stack", "append_stages", "open_stack"]


@contextlib.contextmanager
def layer_stack(runtime=None, *, previous=None, following=None, name: str | None = None):
    """Open a layer stack; stages built inside join it, and it binds what waits when the
    ``with`` block ends (not when it raises).

    Args:
        runtime: the ``BoundaryRuntime`` its stages are built on (default: the engine's).
        previous: the declaration of the stage before this stack (the last stage the
            previous pipeline rank holds), or None where the model's stack starts here.
        following: the declaration of the stage after it (the next pipeline rank's first),
            or None where the model's stack ends here (its last stage is terminal).
        name: a prefix for the names of appended stages without one.
    """
    stack = LayerStack(runtime, previous=previous, following=following, name=name)
    with building_into(stack):
        yield stack
        stack.close()


def append_stages(*items, prepared_from=None, name: str | None = None) -> tuple:
    """Append a local sequence of stages to the open layer stack (``LayerStack.append``).

    Args:
        *items: ``(declaration, norm[, options])`` as ``LayerStack.append`` takes them.
        prepared_from: a branch's source stage on this stack (or its declaration).
        name: the prefix of the stage names.
    """
    stack = open_stack()
    if stack is None:
        raise RuntimeError("append_stages needs an open layer stack: build the model's layers "
                           "inside `with layer_stack(runtime):`")
    return stack.append(*items, prepared_from=prepared_from, name=name)


def detached(declaration):
    """A declaration as its neighbour names it: without its own sources (a producer's
    ``previous`` chain is its own business) and not terminal."""
    if declaration is None:
        return None
    return dataclasses.replace(declaration, previous=None, prepared_from=None, terminal=False)


def _neighbour(declaration, field: str):
    if declaration is not None and not isinstance(declaration, StageDeclaration):
        raise TypeError(f"layer_stack {field}= takes a StageDeclaration (the neighbouring "
                        f"stage's declaration), got {type(declaration).__name__}")
    return detached(declaration)


def _with_terminal(declaration, terminal: bool):
    """``declaration`` ending the stack or not; the same object where that holds already."""
    if declaration.terminal == terminal:
        return declaration
    return dataclasses.replace(declaration, terminal=terminal)


class _Pending:
    """A stage waiting for its consumer to be known."""

    __slots__ = ("stage", "declaration")

    def __init__(self, stage, declaration) -> None:
        self.stage, self.declaration = stage, declaration


class LayerStack:
    """A model's stages in build order, the neighbours of each and its branches.

    Args:
        runtime: the ``BoundaryRuntime`` its stages are built on (default: the engine's).
        previous, following: the neighbouring stages' declarations beyond this stack (on
            other pipeline ranks); see ``layer_stack``.
        name: a prefix for the names of appended stages without one.
    """

    def __init__(self, runtime=None, *, previous=None, following=None,
                 name: str | None = None) -> None:
        self.runtime = runtime if runtime is not None else get_runtime()
        self.previous = _neighbour(previous, "previous")
        self.following = _neighbour(following, "following")
        self.name = name
        self.stages: list = []  # every stage, branches included, in build order
        self._pending: _Pending | None = None  # the main line's last appended stage
        self._branch_ends: list[_Pending] = []  # branches merging before the main line goes on
        self.closed = False

    def __repr__(self) -> str:
        return f"LayerStack({len(self.stages)} stages{', closed' if self.closed else ''})"

    # -- what the model reads

    @property
    def main_line(self) -> list:
        """The stack's own stages in order (branches are side paths)."""
        return [s for s in self.stages if s.branch_source is None]

    @property
    def first(self):
        """The first stage of the main line: a pipeline receiver's ``from_pp`` stage."""
        line = self.main_line
        if not line:
            raise RuntimeError("this layer stack holds no stage")
        return line[0]

    @property
    def last(self):
        line = self.main_line
        if not line:
            raise RuntimeError("this layer stack holds no stage")
        return line[-1]

    # -- building

    def append(self, *items, prepared_from=None, name: str | None = None) -> tuple:
        """Append a local sequence of stages; returns one ``StageBoundary`` per item.

        Args:
            *items: ``(declaration, norm[, options])``; declarations carry no ``previous``,
                ``prepared_from`` or ``terminal`` (the stack supplies them). Options:
                ``fusions``, and ``qkv_latent_func`` for an attention.
            prepared_from: the stage on this stack (or its declaration) whose prepared input
                this sequence reads: a branch, entered with ``branch_input`` and merged back
                with ``merge_branch`` before the main line's next stage.
            name: the prefix of the stage names ("<name>.attn"); default the stack's.
        """
        self._check_open()
        checked = check_items(items, "append_stages")
        source = None if prepared_from is None else self._source(prepared_from)
        decls = []
        if source is None:
            previous = (detached(self._pending.declaration) if self._pending is not None
                        else self._previous_of_next())
        else:
            previous = None
        for i, (decl, _, _) in enumerate(checked):
            decls.append(dataclasses.replace(
                decl, previous=previous if i == 0 else detached(decls[-1]),
                prepared_from=source.declaration if (source is not None and i == 0) else None))
        names = stage_names(name or self.name, [d.kind for d in decls])
        if source is None:
            check_next_sparse(previous, [d for d, _, _ in checked], "append_stages")
            self._check_entry(names[0], decls[0])
            self._bind_pending(following=detached(decls[0]))
        stages = []
        for i, (decl, (_, norm, options)) in enumerate(zip(decls, checked)):
            last = i == len(decls) - 1  # its consumer is the next main-line append, or the end
            following = None if last else detached(decls[i + 1])
            stage = StageBoundary(decl, norm, following=following, runtime=self.runtime,
                                  name=names[i], branch_source=source and source.declaration,
                                  bind=not last, **options)
            stages.append(stage)
            if last and source is None:
                self._pending = _Pending(stage, decl)
            elif last:
                self._branch_ends.append(_Pending(stage, decl))
        for stage in stages:
            self._join(stage)
        if source is not None:
            link_branch(source, stages[0])
        return tuple(stages)

    def adopt(self, stages, source=None) -> None:
        """Stages ``make_stages`` built inside this stack (explicit neighbours): each is
        checked against the stage built before it, then joins; a branch's first stage is
        linked to ``source`` (default: the stage on this stack it is prepared from)."""
        self._check_open()
        for stage in stages:
            decl = stage.declaration
            if decl.prepared_from is None:
                if not self.main_line:
                    self._check_entry(stage.name, decl)
                self._bind_pending(following=detached(decl))
            else:
                link_branch(source or self._source(decl.prepared_from), stage)
            self._check_neighbours(stage)
            self._join(stage)

    def close(self) -> None:
        """End the stack: the stages waiting for a consumer bind (the main line's last one
        terminal unless the stack has a ``following``)."""
        if self.closed:
            return
        waiting = self._pending or (self._branch_ends[-1] if self._branch_ends else None)
        line = self.main_line
        if waiting is not None and self.following is None:
            self._check_exit(waiting.stage.name)
        elif waiting is None and line and line[-1].declaration.terminal:  # make_stages said so
            self._check_exit(line[-1].name)
        self._bind_pending(following=self.following, end=True)
        self.closed = True

    # -- internals

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this layer stack is closed; open a new one for another stack")

    def _pipeline(self) -> tuple[int, int]:
        par = self.runtime.parallel
        return par.pp_rank, par.dims.pp

    def _check_entry(self, name: str, decl) -> None:
        """The main line's first stage: on a later pipeline rank its producer lives on the
        rank before, and what crosses there must be something this rank can complete."""
        rank, pp = self._pipeline()
        if decl.previous is None and rank > 0 and not self.main_line:
            raise UnsupportedBoundary(
                f"stage {name} would enter the model's stack (previous=None) on pipeline rank "
                f"{rank} of {pp}: its producer is the last stage of pipeline rank {rank - 1}; "
                "open this rank's layer_stack with previous= that stage's declaration")
        prev = decl.previous
        if prev is None or self.main_line:
            return
        # a sum the producer always leaves arrives unreduced, and this rank's copy of the
        # producer's update completes it (what from_pp rebuilds)
        declared_sum = prev.kind is StageKind.ATTN and (
            prev.reduction is ProducerReduction.PARTIAL or decl.kind is StageKind.FFN)
        if rank > 0 and declared_sum and not is_portable(prev.residual.update):
            raise UnsupportedBoundary(
                f"stage {name}: its producer on pipeline rank {rank - 1} "
                f"({prev.describe()}) leaves a declared partial sum that crosses the pipeline "
                f"cut, and its update {prev.residual.update!r} is not portable (this rank's "
                "copy of it would complete the sum, without the producer's own state); cut "
                "the pipeline after a stage that completes its output")

    def _check_exit(self, name: str) -> None:
        """The main line's last stage ends the model's stack: never before the last rank."""
        rank, pp = self._pipeline()
        if rank < pp - 1:
            raise UnsupportedBoundary(
                f"stage {name} would end the model's stack (terminal) on "
                f"pipeline rank {rank} of {pp}: its consumer is the first stage of pipeline "
                f"rank {rank + 1}; open this rank's layer_stack with following= that stage's "
                "declaration")

    def _previous_of_next(self):
        """What the next main-line stage names as its producer: the main line's last stage
        (built by make_stages), or the stack's own ``previous`` before any stage."""
        line = self.main_line
        if not line:
            return self.previous
        last = line[-1]
        return None if last.declaration.terminal else detached(last.declaration)

    def _bind_pending(self, following, end: bool = False) -> None:
        """The waiting stages meet their consumer: the main line's last stage, and the last
        stage of each branch merged into its output since."""
        main, ends = self._pending, self._branch_ends
        self._pending, self._branch_ends = None, []
        terminal = end and following is None
        if main is not None:
            old = main.declaration
            new = _with_terminal(old, terminal)
            main.stage.bind(new, following)
            if new is not old:
                self._source_became(old, new, ends)
        for pending in ends:
            pending.stage.bind(_with_terminal(pending.declaration, terminal), following)

    def _source_became(self, old, new, waiting) -> None:
        """A branch source's declaration, final now (terminal): its branch names it as it is
        (plans find a branch's source by its declaration)."""
        for stage in self.stages:
            if stage.branch_source is old:
                stage.branch_source = new
            if stage.declaration.prepared_from is not old:
                continue
            decl = dataclasses.replace(stage.declaration, prepared_from=new)
            end = next((p for p in waiting if p.stage is stage), None)
            if end is not None:  # binds next, with the others
                end.declaration = decl
            else:
                stage.bind(decl, stage.following)

    def _join(self, stage) -> None:
        stage.stack, stage.order = self, len(self.stages)
        self.stages.append(stage)

    def _source(self, prepared_from):
        """The stage of this stack whose declaration a branch is prepared from."""
        if isinstance(prepared_from, StageBoundary):
            if prepared_from not in self.stages:
                raise UnsupportedBoundary(f"prepared_from={prepared_from.name} is not a stage "
                                          "of this layer stack")
            return prepared_from
        found = next((s for s in reversed(self.stages) if s.declaration is prepared_from), None)
        if found is None:
            raise UnsupportedBoundary("prepared_from must be the declaration of a stage already "
                                      "on this layer stack")
        return found

    def _check_neighbours(self, stage) -> None:
        """The stage built before this one is its producer: each must describe the other as
        it is. A stage entering the stack (no ``previous``), a prepared branch, and the stage
        after a terminal one or after a branch (the model's merge is its producer) are not
        checked."""
        decl = stage.declaration
        built = self.stages[-1] if self.stages else None
        if decl.previous is None or decl.prepared_from is not None or built is None:
            return
        if built.declaration.terminal or built.branch_source is not None:
            return
        differ = fact_differences(decl.previous, built.declaration)
        if differ:
            raise UnsupportedBoundary(
                f"stage {stage.name} declares previous={decl.previous.describe()}, but its "
                f"producer, stage {built.name}, is {built.declaration.describe()}: they differ "
                f"in {differ}")
        if built.following is not None:
            differ = fact_differences(built.following, decl)
            if differ:
                raise UnsupportedBoundary(
                    f"stage {built.name} declares following={built.following.describe()}, but "
                    f"the next stage, {stage.name}, is {decl.describe()}: they differ in "
                    f"{differ}")
