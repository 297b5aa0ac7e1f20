"""Model-stack entry and exit, and the accessors that change a layer output legitimately.

Every accessor takes the object the last boundary call returned and returns the object the
model must hold next.
"""

from __future__ import annotations

import torch

from ..output import HandoffOutput, complete_unfused
from ..runtime.ledger import LEDGER
from ..stage import stream_of
from .access import complete_contribution
from .add_norm import ADD_NORM_READ
from .stream import ResidualStream

PENDING_AT_TAKE = "write the residual update before taking the final output"
SNAPSHOT_NOT_PLAIN = "snapshot requires a plain residual update"


def start(forward_batch) -> ResidualStream:
    """Begin the layer stack: a fresh, initial stream for this forward batch."""
    stream = ResidualStream()
    forward_batch.residual_stream = stream
    return stream


def _checked(hidden_states, forward_batch) -> ResidualStream:
    stream = stream_of(forward_batch)
    stream.check(hidden_states)
    return stream


def complete_output(hidden_states, forward_batch):
    """Finish outstanding communication/finalize work; the residual update stays pending."""
    stream = _checked(hidden_states, forward_batch)
    if stream.contribution is None:
        return hidden_states
    return complete_contribution(stream).value


def fold(hidden_states, forward_batch) -> torch.Tensor:
    """Complete a plain contribution and fold it into the residual; the stream is written."""
    stream = _checked(hidden_states, forward_batch)
    if stream.contribution is None:
        if stream.residual is None:
            raise RuntimeError("fold() needs a residual or a pending contribution; the stream is initial")
        return stream.residual
    c = complete_contribution(stream)
    residual = c.update.apply(stream.residual, c.value)
    stream.write(residual, residual)
    return residual


def written(hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
    """Replace the stream with a written one whose residual is ``hidden_states``.

    Discards any pending contribution: call fold() first when one may be pending.
    """
    stream_of(forward_batch).write(hidden_states, hidden_states)
    return hidden_states


def take_output(hidden_states, forward_batch) -> torch.Tensor:
    """Release the stream at a terminal exit whose output is already written."""
    stream = _checked(hidden_states, forward_batch)
    if stream.contribution is not None:
        raise RuntimeError(PENDING_AT_TAKE)
    residual = stream.residual if stream.residual is not None else hidden_states
    forward_batch.residual_stream = None
    return residual


def snapshot(hidden_states, forward_batch) -> torch.Tensor:
    """An owned residual with the pending update applied; the main contribution is untouched."""
    stream = _checked(hidden_states, forward_batch)
    c = stream.contribution
    if c is None:
        if stream.residual is None:
            raise RuntimeError("snapshot() on an initial stream: nothing has been written yet")
        return stream.residual.clone()
    if not c.update.plain or isinstance(c.value, HandoffOutput):
        raise RuntimeError(SNAPSHOT_NOT_PLAIN)
    value = complete_unfused(c.value.clone(), c.owed) if c.owed is not None else c.value
    return c.update.apply(stream.residual, value)


def add_to_output(hidden_states, forward_batch, extra: torch.Tensor):
    """Complete the contribution, then add ``extra`` once; the residual update stays pending."""
    stream = _checked(hidden_states, forward_batch)
    if stream.contribution is None:
        if stream.residual is None:
            raise RuntimeError("add_to_output() on an initial stream: start the stack with the "
                               "embedding, not an extra contribution")
        from .add_norm import PLAIN_ADD

        return stream.leave(extra, None, PLAIN_ADD)
    c = complete_contribution(stream)
    return stream.leave(c.value + extra, None, c.update)


def norm(hidden_states, forward_batch, norm_module, *, skip_empty: bool = False,
         capture_output=None, handoff_norm=None) -> torch.Tensor:
    """Leave the stack: complete owed work, apply the update, apply the final norm.

    With ``skip_empty`` an empty batch still completes owed work (a collective its peers
    join) and skips only the norm kernel. The stream is released.
    """
    stream = _checked(hidden_states, forward_batch)
    LEDGER.site = "final_norm"
    c = stream.contribution
    read_norm = norm_module if hasattr(norm_module, "normalize_fp32") else None
    if c is None:
        residual = stream.residual if stream.residual is not None else hidden_states
        out = None
    else:
        if handoff_norm is not None and isinstance(c.value, HandoffOutput):
            if capture_output is not None:
                raise RuntimeError("norm() with handoff_norm does not accept capture_output "
                                   "when a handoff arrives")
            forward_batch.residual_stream = None
            return handoff_norm.finalize(c.value, stream.residual, norm_module)
        value = complete_unfused(c.value, c.owed)
        if skip_empty and value.shape[0] == 0:
            residual, out = c.update.apply(stream.residual, value), value
        elif read_norm is not None:
            out, residual = ADD_NORM_READ.update_and_read(c.update, stream.residual, value, read_norm)
        else:
            residual = c.update.apply(stream.residual, value)
            out = norm_module(residual)
    if out is None:
        out = residual if (skip_empty and residual.shape[0] == 0) else norm_module(residual)
    if capture_output is not None:
        capture_output(residual, owned=False)
    forward_batch.residual_stream = None
    return out
