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

Stages join a stack two ways:

- ``append_stages(*items, prepared_from=None, name=None)`` (or ``stack.append``): the stack
  supplies each stage's ``previous`` (the stage appended before it on the stack's main line,
  or the stack's own ``previous``: the stage another pipeline rank holds) and ``terminal``
  (the main line's last stage when the stack closes without a ``following``). A stage binds
  its plan once both neighbours are known: at the next append, or when the stack closes.
  A branch (``prepared_from``: the declaration of a stage on this stack) is a side path the
  model merges back itself: its stages bind with only each other.
- ``make_stages(...)`` with explicit ``previous``/``following``/``terminal`` binds at once; inside
  an open stack its stages join it and are checked against the stages built next to them.

The open stack is a construction scope (a context variable, like the forward-flag scope):
``append_stages`` and ``make_stages`` find it there, and it is gone when the ``with`` ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
from contextvars import ContextVar

from .construction import UnsupportedBoundary
from .residual import LayerResidual
from .runtime.args import get_runtime

__all__ = ["LayerStack", "layer_stack", "append_stages", "open_stack"]

_OPEN: ContextVar = ContextVar("layer_boundary_open_stack", default=None)


def open_stack() -> "LayerStack | None":
    """The stack the current construction scope builds into, if any."""
    return _OPEN.get()


@contextlib.contextmanager
def layer_stack(runtime=None, *, previous=None, following=None, name: str | None = None):
    """Open a layer stack; stages built inside join it, and it binds what waits when the
    ``with`` block ends (not when it raises).

    Args:
        runtime: the ``BoundaryRuntime`` its stages are built on (default: the engine's).
        previous: the declaration of the stage before this stack (the last stage another
            pipeline rank holds), or None where the model's stack starts here.
        following: the declaration of the stage after it (the next pipeline rank's first),
            or None where the model's stack ends here (its last stage is terminal).
        name: a prefix for the names of appended stages without one.
    """
    stack = LayerStack(runtime, previous=previous, following=following, name=name)
    token = _OPEN.set(stack)
    try:
        yield stack
        stack.close()
    finally:
        _OPEN.reset(token)


def append_stages(*items, prepared_from=None, name: str | None = None) -> tuple:
    """Append a local sequence of stages to the open layer stack (``LayerStack.append``)."""
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


def _bare(decl):
    """A declaration without its neighbours, for comparing what two sides say of a stage. A
    producer's read is its own input's business: its consumer relies on its update only."""
    residual = LayerResidual(decl.residual.update, None)
    return dataclasses.replace(decl, previous=None, prepared_from=None, terminal=False,
                               residual=residual)


def _differences(declared, built) -> str:
    """The fields in which two bare declarations differ, each as declared vs built."""
    out = []
    for f in dataclasses.fields(declared):
        if not f.compare:  # a label (mixer), not a fact the neighbours must agree on
            continue
        said, real = getattr(declared, f.name), getattr(built, f.name)
        if said != real:
            name = f.name
            if name == "residual":
                name, said, real = "update", said.update, real.update
            out.append(f"{name} (declared {said!r}, built {real!r})")
    return "; ".join(out)


class _Pending:
    """The main line's last appended stage, waiting for its consumer to be known."""

    __slots__ = ("stage", "declaration")

    def __init__(self, stage, declaration) -> None:
        self.stage, self.declaration = stage, declaration


class LayerStack:
    """A model's stages in build order, the neighbours of each and its branches."""

    def __init__(self, runtime=None, *, previous=None, following=None,
                 name: str | None = None) -> None:
        self.runtime = runtime if runtime is not None else get_runtime()
        self.previous, self.following, self.name = previous, following, name
        self.stages: list = []  # every stage, branches included, in build order
        self._pending: _Pending | None = None
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
            prepared_from: the declaration of a stage already on this stack whose prepared
                input this sequence reads (a branch; enter it with ``branch_input``).
            name: the prefix of the stage names ("<name>.attn"); default the stack's.
        """
        from .factories import check_items, link_branch, stage_names
        from .stage import StageBoundary

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
        if source is None:
            self._bind_pending(following=detached(decls[0]))
        names = stage_names(name or self.name, [d.kind for d in decls])
        stages = []
        for i, (decl, (_, norm, options)) in enumerate(zip(decls, checked)):
            last = i == len(decls) - 1
            wait = last and source is None  # its consumer is the next append, or the end
            following = None if last else detached(decls[i + 1])
            stage = StageBoundary(decl, norm, following=following, runtime=self.runtime,
                                  name=names[i], branch_source=source and source.declaration,
                                  bind=not wait, **options)
            stages.append(stage)
            if wait:
                self._pending = _Pending(stage, decl)
        for stage in stages:
            self._join(stage)
        if source is not None:
            link_branch(source, stages[0])
        return tuple(stages)

    def adopt(self, stages, source=None) -> None:
        """Stages ``make_stages`` built inside this stack (explicit neighbours): each is
        checked against the stage built before it, then joins; a branch's first stage is
        linked to ``source`` (default: the stage on this stack it is prepared from)."""
        from .factories import link_branch

        self._check_open()
        for stage in stages:
            decl = stage.declaration
            if decl.prepared_from is None:
                self._bind_pending(following=detached(decl))
            else:
                link_branch(source or self._source(decl.prepared_from), stage)
            self._check_neighbours(stage)
            self._join(stage)

    def close(self) -> None:
        """End the stack: the main line's last appended stage binds (terminal unless the
        stack has a ``following``)."""
        if self.closed:
            return
        self._bind_pending(following=self.following, end=True)
        self.closed = True

    # -- internals

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this layer stack is closed; open a new one for another stack")

    def _previous_of_next(self):
        """What the next main-line stage names as its producer: the main line's last stage
        (built by make_stages), or the stack's own ``previous`` before any stage."""
        line = self.main_line
        if not line:
            return detached(self.previous)
        last = line[-1]
        return None if last.declaration.terminal else detached(last.declaration)

    def _bind_pending(self, following, end: bool = False) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        terminal = end and following is None
        pending.stage.bind(dataclasses.replace(pending.declaration, terminal=terminal), following)

    def _join(self, stage) -> None:
        stage.stack, stage.order = self, len(self.stages)
        self.stages.append(stage)

    def _source(self, prepared_from):
        """The stage of this stack whose declaration a branch is prepared from."""
        from .stage import StageBoundary

        if isinstance(prepared_from, StageBoundary):
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
        said, real = _bare(decl.previous), _bare(built.declaration)
        if said != real:
            raise UnsupportedBoundary(
                f"stage {stage.name} declares previous={decl.previous.describe()}, but its "
                f"producer, stage {built.name}, is {built.declaration.describe()}: they differ "
                f"in {_differences(said, real)}")
        if built.following is not None:
            said, real = _bare(built.following), _bare(decl)
            if said != real:
                raise UnsupportedBoundary(
                    f"stage {built.name} declares following={built.following.describe()}, but "
                    f"the next stage, {stage.name}, is {decl.describe()}: they differ in "
                    f"{_differences(said, real)}")

