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
from typing import NamedTuple

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


class Turn(enum.Enum):
    """What a stream's handle is while a stage holds its turn: no layer output, so no tensor
    the model passes matches it. (Between calls the handle is the object the last call
    returned; while an ``exit()`` scope holds the turn, that exit object.)"""

    PREPARED = "prepared"  # prepare() returned the compute input; exit() or finish() next
    COMPUTING = "computing"  # StageBoundary.run() runs compute in its own scope

    def __repr__(self) -> str:
        return f"<stage turn: {self.value}>"


IN_COMPUTE, COMPUTING = Turn.PREPARED, Turn.COMPUTING


class ArrivalKey(NamedTuple):
    """What a consumer's input path dispatches on: what an output still owes (a sum group's
    value, or None), the rows it is on (a layout's key) and whether it is a finalize handoff.
    Plain strings and a bool, so a forward hashes it cheaply."""

    owed: str | None
    rows: str
    handoff: bool


def arrival_key(owed: SumGroup | None, rows: Layout, handoff: bool) -> ArrivalKey:
    return ArrivalKey(None if owed is None else owed.value, rows.key, handoff)


class Contribution:
    """A producer's actual output: its value, the sum it still owes, and its residual update.

    Made in one place, ``ResidualStream.leave``. ``value``: a torch.Tensor, or a
    HandoffOutput for producer-specific finalize work; ``owed``: the SumGroup it still owes
    (None: complete); ``update``: its StageUpdate; ``rows``: where ``value``'s rows are (None:
    left before any boundary placed the rows, until ``place``). ``declared``: the owed sum is
    the producer's static contract (a PARTIAL attention's), not an exit's per-batch decision.
    ``completed_declared``: an accessor completed the producer's declared sum (which a
    pipeline receiver would perform again): to_pp() refuses such a contribution. ``key``: what
    a consumer's input path dispatches on (``ArrivalKey``).
    """

    __slots__ = ("value", "owed", "update", "rows", "handoff", "declared",
                 "completed_declared", "key")

    def place(self, rows: Layout) -> None:
        """The rows of a contribution left before any boundary placed them."""
        self.rows, self.key = rows, arrival_key(self.owed, rows, self.handoff)


class OwedOutput:
    """Opaque handle for an output whose reduction is still owed. Not a tensor on purpose."""

    __slots__ = ("_stream",)

    def __init__(self, stream: ResidualStream) -> None:
        self._stream = stream

    def __repr__(self) -> str:
        return "OwedOutput(<pass to the next boundary or a residual accessor>)"


@dataclass(eq=False, slots=True)
class ForwardState:
    """The package's per-forward state on ``ForwardBatch.boundary``: one object, typed.

    ``stream``: the residual stream between stack entry and exit (None after it left);
    ``facts``: the row facts the forward's first boundary placed (``ops.RowFacts``), with the
    runtime that placed them and the (variant, mode) key the stages' plans select on;
    ``segment``: between split-prefill segments, (next layer, the handle to resume with);
    ``moved``: per-token facts moved onto a stage's compute rows (``to_compute_rows``), by
    the movement, with the tensor they were moved from;
    ``microbatches``: a two-batch-overlap forward's two microbatches;
    ``plain``: decided once per forward, where its rows are placed: no LoRA adapter runs
    and no sum is issued early (two-batch overlap), so a stage's fixed exit opens without
    an exit object;
    ``memo``: what the model's layers compute once per forward and share (the rotary cos/sin
    of its positions: ``models.rope.forward_cos_sin``), gone with the forward.
    """

    stream: ResidualStream | None = None
    facts: object = None
    runtime: object = None  # the BoundaryRuntime that placed the facts
    path_key: tuple = ()  # a contracts.PathKey (batch variant, row mode): what plans select on
    plain: bool = True
    segment: tuple | None = None
    moved: dict = field(default_factory=dict)
    memo: dict = field(default_factory=dict)
    microbatches: list | None = None


class ResidualStream:
    """One forward's residual between the stack's entry and exit: the residual tensor and
    its rows, the producer's pending contribution, and the handle the model must pass to the
    next boundary call (a branch's stream forks from its ``parent``)."""

    __slots__ = ("residual", "residual_rows", "contribution", "handle", "stage", "step",
                 "prepared_input", "parent", "branch_output", "owner", "pending", "made_by",
                 "beside")

    def __init__(self, parent: ResidualStream | None = None) -> None:
        self.residual: torch.Tensor | None = None
        self.residual_rows: Layout | None = None
        self.contribution: Contribution | None = None
        self.handle: object = None  # what the model must pass to the next call
        # the stage whose turn it is (its last prepare(), or a branch's entry), the bound
        # step it prepared on (None: a branch's entry, which selects its own) and the
        # compute input it returned
        self.stage = self.step = self.prepared_input = None
        self.parent = parent  # a branch's stream: the stream it forked from
        self.branch_output: object = None  # a branch's output, once branch_output() made it
        self.owner = None  # weakref to the forward batch the stream was started or arrived on
        # collectives issued asynchronously for the contribution (two-batch overlap), waited
        # on by the next boundary call on this stream
        self.pending: list | None = None
        # the update whose apply made the residual (None: the stack's input, or what the model
        # wrote before any update): an extra joins a residual only where that update is plain
        self.made_by = None
        # a parallel block's attention output, set aside while the FFN beside it reads the
        # same residual; it joins the FFN's output at its finish (``parallel_block.join``)
        self.beside: Contribution | None = None

    @classmethod
    def arrive(cls, forward_batch) -> ResidualStream:
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

    def leave(self, value, owed: SumGroup | None, update, rows: Layout | None,
              handoff: bool = False, declared: bool = False, key: ArrivalKey | None = None,
              completed_declared: bool = False) -> object:
        """Record a producer's output on ``rows`` (None: not placed yet, local); return what
        the model passes on. The one place a ``Contribution`` is made.

        Args:
            value, owed, update, rows, handoff, declared, completed_declared: its fields.
            key: its arrival key, where the caller bound it already.
        """
        # made without __init__ (its fields are set below); object.__new__ spelled out, since
        # dynamo 2.11/2.12 cannot call a builtin's method through a module alias
        c = self.contribution = object.__new__(Contribution)
        c.value, c.owed, c.update, c.rows, c.handoff = value, owed, update, rows, handoff
        c.declared, c.completed_declared = declared, completed_declared
        c.key = (key if key is not None or rows is None
                 else arrival_key(owed, rows, handoff))
        handle = self.handle = OwedOutput(self) if (owed is not None or handoff) else value
        return handle

    def write(self, residual: torch.Tensor, handle: object, rows: Layout) -> None:
        """Residual written on ``rows``, nothing pending; ``handle`` is what the model holds next.
        A pending contribution consumed here made the residual (its update is ``made_by``)."""
        if self.contribution is not None:
            self.made_by = self.contribution.update
        self.residual, self.residual_rows = residual, rows
        self.contribution, self.handle = None, handle

    # -- the turn's transitions: the one place the stream's slots are written

    def begin(self, stage, step, compute_input) -> None:
        """``stage`` holds the turn: its prepare (on bound ``step``; None for a branch's entry,
        which selects its own) returned ``compute_input``."""
        self.stage, self.step, self.prepared_input = stage, step, compute_input

    def bind_step(self, step) -> None:
        """A branch's entry chose its step at its exit (its prepare was ``branch_input``)."""
        self.step = step

    def hold(self, holder) -> None:
        """Something other than a layer output holds the turn: an exit object while its scope
        is open, or ``Turn.COMPUTING`` while ``StageBoundary.run`` computes."""
        self.handle = holder

    def expose(self, value) -> None:
        """The pending contribution's value, complete where it is, is the handle now (an
        opaque handle may have stood in for it)."""
        self.handle = value

    def issue(self, issued: list | None) -> None:
        """The contribution's collectives were issued asynchronously (two-batch overlap): the
        next boundary call waits for ``issued``; the handle is opaque meanwhile."""
        self.pending = issued or None
        self.handle = OwedOutput(self)

    def rebuild(self, residual: torch.Tensor, rows: Layout, made_by) -> OwedOutput:
        """A pipeline receiver's stream: the residual the previous stage sent, on ``rows``,
        made by ``made_by``; nothing pending. Returns the (opaque) handle."""
        self.residual, self.residual_rows, self.made_by = residual, rows, made_by
        self.handle = OwedOutput(self)
        return self.handle

    def fork(self, entry, compute_input) -> ResidualStream:
        """A branch's stream: this stream's residual (the source's), installed on the same
        forward batch, with ``entry``'s turn taken and its input ``compute_input``."""
        branch = ResidualStream(parent=self)
        branch.owner = self.owner
        branch.residual, branch.residual_rows = self.residual, self.residual_rows
        branch.made_by = self.made_by
        branch.handle = Turn.PREPARED
        branch.begin(entry, None, compute_input)
        return branch

    def close_branch(self, value) -> None:
        """A branch's last output, complete on local rows: what ``merge_branch`` takes."""
        self.branch_output = value

    def rejoin(self, branch: ResidualStream) -> None:
        """Back from ``branch``: its residual is this stream's again."""
        self.residual, self.residual_rows = branch.residual, branch.residual_rows

    def set_aside(self) -> Contribution:
        """Hold the pending contribution beside the turn (a parallel block's attention output,
        while its FFN reads the residual): the stream is written again until ``take_beside``."""
        c, self.beside, self.contribution = self.contribution, self.contribution, None
        return c

    def take_beside(self) -> Contribution | None:
        """The contribution ``set_aside`` held (None: none), no longer held."""
        c, self.beside = self.beside, None
        return c

    def extra_update(self):
        """The update an extra added now joins: the pending one, or the one that made the
        written residual (None: a residual no update has made yet)."""
        c = self.contribution
        return c.update if c is not None else self.made_by


def release(forward_batch) -> None:
    """The stack has left: the forward holds no stream (its row facts stay, for reports) and
    no per-forward tables (a compiled forward hands none back)."""
    state = forward_batch.boundary
    state.stream = None
    state.memo.clear()


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
