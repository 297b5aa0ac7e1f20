"""Model-stack entry and exit, and the accessors that change a layer output legitimately.

Every accessor takes the object the last boundary call returned and returns the object the
model must hold next. Tensors a model passes in or gets back are on its DP rank's local rows;
the residual itself may live scattered over attention TP in between.
"""

from __future__ import annotations

import torch

from ..fusions import Arrival
from ..layout import Rows
from ..output import HandoffOutput, complete_value
from ..runtime.ledger import LEDGER
from ..stage import stream_of
from .access import complete_contribution, target_rows, to_local
from .add_norm import ADD_NORM_READ, PLAIN_ADD
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
    return complete_contribution(stream, forward_batch.rows).value


def fold(hidden_states, forward_batch) -> torch.Tensor:
    """Complete a plain contribution and fold it into the residual; the stream is written."""
    stream = _checked(hidden_states, forward_batch)
    if stream.contribution is None:
        if stream.residual is None:
            raise RuntimeError("fold() needs a residual or a pending contribution; the stream is initial")
        return stream.residual
    c = complete_contribution(stream, forward_batch.rows)
    residual = c.update.apply(stream.residual, c.value)
    stream.write(residual, residual, c.rows)
    return residual


def written(hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
    """Replace the stream with a written one whose residual is ``hidden_states`` (local rows).

    Discards any pending contribution: call fold() first when one may be pending.
    """
    stream_of(forward_batch).write(hidden_states, hidden_states, Rows.LOCAL)
    return hidden_states


def take_output(hidden_states, forward_batch) -> torch.Tensor:
    """Release the stream at a terminal exit whose output is already written."""
    stream = _checked(hidden_states, forward_batch)
    if stream.contribution is not None:
        raise RuntimeError(PENDING_AT_TAKE)
    if stream.residual is None:
        residual = hidden_states
    else:
        residual = to_local(stream, stream.residual, forward_batch.rows)
    forward_batch.residual_stream = None
    return residual


def snapshot(hidden_states, forward_batch) -> torch.Tensor:
    """An owned residual with the pending update applied, on local rows; the main
    contribution is untouched (its sum, if owed, runs on a copy)."""
    stream = _checked(hidden_states, forward_batch)
    c = stream.contribution
    if c is None:
        if stream.residual is None:
            raise RuntimeError("snapshot() on an initial stream: nothing has been written yet")
        return to_local(stream, stream.residual.clone(), forward_batch.rows)
    if not c.update.plain or isinstance(c.value, HandoffOutput):
        raise RuntimeError(SNAPSHOT_NOT_PLAIN)
    target = target_rows(stream)
    value = complete_value(c.value.clone(), c.owed, c.rows, target, forward_batch.rows)
    return to_local(stream, c.update.apply(stream.residual, value), forward_batch.rows)


def add_to_output(hidden_states, forward_batch, extra: torch.Tensor):
    """Complete the contribution, then add ``extra`` (local rows) once; the residual update
    stays pending."""
    stream = _checked(hidden_states, forward_batch)
    rows = forward_batch.rows
    if stream.contribution is None:
        if stream.residual is None:
            raise RuntimeError("add_to_output() on an initial stream: start the stack with the "
                               "embedding, not an extra contribution")
        target = stream.residual_rows
        return stream.leave(complete_value(extra, None, Rows.LOCAL, target, rows), None,
                            PLAIN_ADD, target)
    c = complete_contribution(stream, rows)
    extra = complete_value(extra, None, Rows.LOCAL, c.rows, rows)
    return stream.leave(c.value + extra, None, c.update, c.rows)


def norm(hidden_states, forward_batch, norm_module, *, skip_empty: bool = False,
         capture_output=None, handoff_norm=None) -> torch.Tensor:
    """Leave the stack: complete owed work, apply the update, apply the final norm; the
    result is on local rows and the stream is released.

    With ``skip_empty`` an empty batch still completes owed work (a collective its peers
    join) and skips only the norm kernel.
    """
    stream = _checked(hidden_states, forward_batch)
    LEDGER.site = "final_norm"
    rows = forward_batch.rows
    c = stream.contribution
    out = None
    if c is None:
        residual = stream.residual if stream.residual is not None else hidden_states
    else:
        if handoff_norm is not None and isinstance(c.value, HandoffOutput):
            if capture_output is not None:
                raise RuntimeError("norm() with handoff_norm does not accept capture_output "
                                   "when a handoff arrives")
            fused = handoff_norm.finalize(Arrival(
                c.value, c.owed, c.rows, c.update, stream.residual, stream.residual_rows,
                norm_module, rows))
            if fused is not None:
                out, residual = fused
        if out is None:
            value = complete_value(c.value, c.owed, c.rows, target_rows(stream), rows)
            if not hasattr(norm_module, "normalize_fp32") or (skip_empty and value.shape[0] == 0):
                residual = c.update.apply(stream.residual, value)
            else:
                out, residual = ADD_NORM_READ.update_and_read(c.update, stream.residual, value,
                                                              norm_module)
    if out is None:
        out = residual if (skip_empty and residual.shape[0] == 0) else norm_module(residual)
    local = stream.residual_rows is Rows.LOCAL
    if not local:
        out = to_local(stream, out, rows)
    if capture_output is not None:
        capture_output(to_local(stream, residual, rows), owned=not local)
    if LEDGER.traces is not None:
        stream.write(residual, None, stream.residual_rows)
        LEDGER.trace("final_norm", stream, rows)
    forward_batch.residual_stream = None
    return out
