"""Tensor access helpers: completing a stream's pending work, and its residual, on given rows.

Every movement comes from the forward's prebuilt table (``RowFacts.move``); nothing here
chooses a collective. Before any boundary of a forward has run, its rows are unplaced
(``rows`` is None): everything the model wrote is on its local rows, nothing is owed, and
the helpers move nothing (the layout they name is None, "local, not yet placed").
"""

from __future__ import annotations

from ..layout import Layout
from ..runtime.collectives import issuing_async
from .stream import Contribution, OwedOutput, ResidualStream  # noqa: F401 - types


def local_rows(facts) -> Layout | None:
    """This DP rank's rows: where every tensor a model passes in or gets back lives (None
    while no boundary has placed the forward's rows)."""
    return None if facts is None else facts.layouts.local


def completed(c: Contribution, facts, target: Layout, value=None):
    """``c``'s value (or ``value`` in its place) with its finalize and owed sum done, on
    ``target`` rows."""
    value = c.value if value is None else value
    if c.handoff:
        value = value.complete()
    if facts is None:  # nothing placed: the value is complete, on local rows
        return value
    return facts.movement(c.owed, c.rows, target).move(facts, value)


def complete_onto(stream: ResidualStream, facts, target: Layout) -> Contribution:
    """Finish the stream's owed communication/finalize onto ``target``; the update stays
    pending and the completed value becomes the handle."""
    c = stream.contribution
    if c.owed is None and not c.handoff and c.rows == target:
        stream.expose(c.value)  # already complete there
        return c
    declared = c.completed_declared or (c.declared and c.owed is not None)
    stream.leave(completed(c, facts, target), None, c.update, target,
                 completed_declared=declared)  # the completed value is the handle
    return stream.contribution


def residual_on(stream: ResidualStream, facts, target: Layout):
    """The stream's residual on ``target`` rows (a residual the model wrote is on local rows)."""
    if facts is None:  # no boundary has run in this forward: everything is on local rows
        return stream.residual
    src = stream.residual_rows or facts.layouts.local
    return facts.movement(None, src, target).move(facts, stream.residual)


def start_completion(stream: ResidualStream, facts) -> None:
    """Issue the contribution's owed sum (and finalize) onto the residual's rows now, the
    sums asynchronously: the next boundary call on this stream waits for them, so another
    microbatch computes meanwhile (two-batch overlap). The handle stays opaque."""
    with issuing_async() as issued:
        complete_onto(stream, facts, stream.residual_rows or local_rows(facts))
    stream.issue(issued)
