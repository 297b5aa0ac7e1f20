"""Tensor access helpers: the one place a stream's pending work is completed outside a plan."""

from __future__ import annotations

from ..layout import Rows
from ..output import HandoffOutput, complete_value
from .stream import Contribution, ResidualStream


def target_rows(stream: ResidualStream) -> Rows:
    """Rows an accessor completes onto: where the residual it will meet lives."""
    return stream.residual_rows if stream.residual is not None else Rows.LOCAL


def complete_contribution(stream: ResidualStream, batch_rows) -> Contribution:
    """Finish the stream's owed communication/finalize; the update stays pending."""
    c = stream.contribution
    target = target_rows(stream)
    if c.owed is None and not isinstance(c.value, HandoffOutput) and c.rows is target:
        return c
    done = Contribution(complete_value(c.value, c.owed, c.rows, target, batch_rows), None,
                        c.update, target)
    stream.contribution = done
    stream.handle = done.value
    return done


def to_local(stream: ResidualStream, x, batch_rows):
    """A tensor on the residual's rows, brought back to this DP rank's local rows."""
    if stream.residual_rows is Rows.LOCAL:
        return x
    return complete_value(x, None, stream.residual_rows, Rows.LOCAL, batch_rows)
