"""Per-forward residual state and the ownership of outstanding work.

A stream is initial (nothing yet), written (a residual, nothing pending) or pending (a
producer's contribution, maybe a residual). The model passes back exactly the object each
boundary call returned; the stream checks that by identity, so another microbatch's output, a
rebound tensor or a tensor handed to a stream that has given out nothing raises instead of
silently applying the wrong pending work.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field

import torch

from ..layout import Layout, SumGroup

NOT_OURS = ("output does not belong to this residual stream; "
            "change layer outputs through boundary accessors")
START_FIRST = "start the layer stack before entering a stage"
SHARED_STREAM = ("this residual stream belongs to another forward batch: each two-batch-overlap "
                 "microbatch needs its own stream (ResidualStream.arrive)")


class StreamState(enum.Enum):
    INITIAL = "initial"
    WRITTEN = "written"
    PENDING = "pending"


def arrival_key(owed: SumGroup | None, rows: Layout, handoff: bool) -> tuple:
    """What a consumer's input path dispatches on: plain strings, cheap to hash per call."""
    return (None if owed is None else owed.value, rows.key, handoff)


class Contribution:
    """A producer's actual output: its value, the sum it still owes, and its residual update.

    ``value``: a torch.Tensor, or a HandoffOutput for producer-specific finalize work;
    ``owed``: the SumGroup it still owes (None: complete); ``update``: its StageUpdate;
    ``rows``: where ``value``'s rows are (None: left before any boundary placed the rows,
    until ``place``). ``declared``: the owed sum is the producer's static contract (a PARTIAL
    attention's), not an exit's per-batch decision. ``completed_declared``: an accessor
    completed the producer's declared sum (which a pipeline receiver would perform again):
    to_pp() refuses such a contribution. ``key``: what a consumer's input path dispatches on.
    """

    __slots__ = ("value", "owed", "update", "rows", "handoff", "declared",
                 "completed_declared", "key")

    def __init__(self, value, owed: SumGroup | None, update, rows: Layout | None,
                 handoff: bool = False, declared: bool = False,
                 completed_declared: bool = False, key: tuple | None = None) -> None:
        self.value, self.owed, self.update, self.rows = value, owed, update, rows
        self.handoff, self.declared, self.completed_declared = handoff, declared, completed_declared
        self.key = (key if key is not None else None if rows is None
                    else arrival_key(owed, rows, handoff))

    def place(self, rows: Layout) -> None:
        """The rows of a contribution left before any boundary placed them."""
        self.rows, self.key = rows, arrival_key(self.owed, rows, self.handoff)


class OwedOutput:
    """Opaque handle for an output whose reduction is still owed. Not a tensor on purpose."""

    __slots__ = ("_stream",)

    def __init__(self, stream: "ResidualStream") -> None:
        self._stream = stream

    def __repr__(self) -> str:
        return "OwedOutput(<pass to the next boundary or a residual accessor>)"


class _InCompute:
    """Handle while a stage computes: its prepared input is no layer output."""

    def __repr__(self) -> str:
        return "<stage computing>"


IN_COMPUTE = _InCompute()


class _Computing:
    """The handle while ``StageBoundary.run()`` runs a stage's compute in its own scope."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<stage computing in run()>"


COMPUTING = _Computing()


@dataclass(eq=False, slots=True)
class ForwardState:
    """The package's per-forward state on ``ForwardBatch.boundary``: one object, typed.

    ``stream``: the residual stream between stack entry and exit (None after it left);
    ``facts``: the row facts the forward's first boundary placed (``ops.RowFacts``), with the
    runtime that placed them and the (variant, mode) key the stages' plans select on;
    ``segment``: between split-prefill segments, (next layer, the handle to resume with);
    ``moved``: per-token facts moved onto a stage's compute rows (``to_compute_rows``), by
    the movement, with the tensor they were moved from;
    ``microbatches``: a two-batch-overlap forward's two microbatches.
    """

    stream: "ResidualStream | None" = None
    facts: object = None
    runtime: object = None  # the BoundaryRuntime that placed the facts
    path_key: tuple = ()  # (batch variant, row mode): what the stages' plans select on
    segment: tuple | None = None
    moved: dict = field(default_factory=dict)
    microbatches: list | None = None


class ResidualStream:
    """One forward's residual between the stack's entry and exit: the residual tensor and
    its rows, the producer's pending contribution, and the handle the model must pass to the
    next boundary call (a branch's stream forks from its ``parent``)."""

    __slots__ = ("residual", "residual_rows", "contribution", "handle", "prepared", "parent",
                 "branch_output", "owner", "pending", "made_by")

    def __init__(self, parent: "ResidualStream | None" = None) -> None:
        self.residual: torch.Tensor | None = None
        self.residual_rows: Layout | None = None
        self.contribution: Contribution | None = None
        self.handle: object = None  # what the model must pass to the next call
        # (stage, compute input, its path, row facts) of the last prepare(); a branch's
        # entry has no path selected yet (None, None)
        self.prepared: tuple | None = None
        self.parent = parent  # a branch's stream: the stream it forked from
        self.branch_output: object = None  # a branch's output, once branch_output() made it
        self.owner = None  # weakref to the forward batch the stream was started or arrived on
        # collectives issued asynchronously for the contribution (two-batch overlap), waited
        # on by the next boundary call on this stream
        self.pending: list | None = None
        # the update whose apply made the residual (None: the stack's input, or what the model
        # wrote before any update): an extra joins a residual only where that update is plain
        self.made_by = None

    @classmethod
    def arrive(cls, forward_batch) -> "ResidualStream":
        """A microbatch's own stream (two-batch overlap): fresh, owned by ``forward_batch``,
        with fresh row facts. Its stack input enters through the first stage's prepare()."""
        stream = cls()
        stream.owner = weakref.ref(forward_batch)
        forward_batch.boundary = ForwardState(stream)
        return stream
    @property
    def state(self) -> StreamState:
        if self.contribution is not None:
            return StreamState.PENDING
        return StreamState.INITIAL if self.residual is None else StreamState.WRITTEN

    def check(self, hidden) -> None:
        """Raise unless ``hidden`` is the object the last boundary call returned (an initial
        stream has returned nothing, so nothing belongs to it)."""
        if self.handle is None or hidden is not self.handle:
            raise RuntimeError(NOT_OURS)

    def leave(self, value, owed: SumGroup | None, update, rows: Layout, handoff: bool = False,
              declared: bool = False, key: tuple | None = None) -> object:
        """Record a producer's output on ``rows``; return what the model passes on (``key``:
        its arrival key, where the caller has it already)."""
        self.contribution = Contribution(value, owed, update, rows, handoff, declared, False, key)
        self.handle = OwedOutput(self) if (owed is not None or handoff) else value
        return self.handle

    def write(self, residual: torch.Tensor, handle: object, rows: Layout) -> None:
        """Residual written on ``rows``, nothing pending; ``handle`` is what the model holds next.
        A pending contribution consumed here made the residual (its update is ``made_by``)."""
        if self.contribution is not None:
            self.made_by = self.contribution.update
        self.residual, self.residual_rows = residual, rows
        self.contribution, self.handle = None, handle

    def extra_update(self):
        """The update an extra added now joins: the pending one, or the one that made the
        written residual (None: a residual no update has made yet)."""
        c = self.contribution
        return c.update if c is not None else self.made_by


def release(forward_batch) -> None:
    """The stack has left: the forward holds no stream (its row facts stay, for reports)."""
    forward_batch.boundary.stream = None


def stream_of(forward_batch) -> ResidualStream:
    state = forward_batch.boundary
    if state is None or state.stream is None:
        raise RuntimeError(START_FIRST)
    stream = state.stream
    owner = stream.owner
    if owner is not None and owner() is not forward_batch:
        raise RuntimeError(SHARED_STREAM)
    if stream.pending is not None:  # the result is needed now: wait for its collectives
        for work, _ in stream.pending:
            work.wait()
        stream.pending = None
    return stream
