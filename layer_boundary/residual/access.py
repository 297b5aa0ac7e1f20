"""Tensor access helpers: the one place a stream's pending work is completed outside a plan."""

from __future__ import annotations

from ..output import HandoffOutput, complete_unfused
from .stream import Contribution, ResidualStream


def complete_contribution(stream: ResidualStream) -> Contribution:
    """Finish the stream's owed communication/finalize; the update stays pending."""
    c = stream.contribution
    if c.owed is None and not isinstance(c.value, HandoffOutput):
        return c
    done = Contribution(complete_unfused(c.value, c.owed), None, c.update)
    stream.contribution = done
    stream.handle = done.value
    return done
