"""Model-stack entry and exit, and the accessors that change a layer output legitimately.

Every accessor takes the object the last boundary call returned and returns the object the
model must hold next. Tensors a model passes in or gets back are on its DP rank's local rows,
in every row mode; the residual itself may live scattered over attention TP in between, and
the accessors move it (and complete owed sums) with the forward's prebuilt movements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..layout import SumGroup
from ..runtime.agreement import AGREEMENT
from ..runtime.ledger import active_observer
from . import apply_update, in_forward, is_plain, is_portable, needs_token_rows
from .access import complete_onto, completed, local_rows, residual_on
from .add_norm import ADD_NORM_READ, PLAIN_ADD
from .stream import START_FIRST, ResidualStream, release, stream_of  # noqa: F401 - error text

if TYPE_CHECKING:
    from ..runtime.forward_batch import ForwardBatch

PENDING_AT_TAKE = "write the residual update before taking the final output"
SNAPSHOT_NOT_PLAIN = "snapshot requires a plain residual update"
EXTRA_NOT_PLAIN = "add_to_output() requires a plain residual update"


def check_extra_joins(stream: ResidualStream, refusal: str) -> None:
    """An extra joins the residual as a plain add: into the pending output whose update is a
    plain add, or into a residual a plain update made. An mHC residual is streams whose next
    update needs coefficients a [T, D] extra has no place in, pending or written alike."""
    update = stream.extra_update()
    if update is not None and not is_plain(update):
        raise RuntimeError(refusal)


def start(forward_batch: ForwardBatch) -> ResidualStream:
    """Begin the layer stack: a fresh, initial stream for this forward batch (and fresh row
    facts: the first boundary computes them from the batch's DP token counts).

    Args:
        forward_batch: the batch the stack runs; its ``boundary`` state is replaced.

    With the agreement check on, the forward's inputs that every rank's decisions come from
    (its variant, every DP rank's token counts after padding, its two-batch split) start the
    notes its collectives compare (``runtime.agreement``).
    """
    if AGREEMENT.on:
        AGREEMENT.begin("forward", "batch", f"{forward_batch.variant.value}, counts "
                                            f"{tuple(forward_batch.dp_token_counts)}, "
                                            f"{forward_batch.two_batch.value}")
    return ResidualStream.arrive(forward_batch)


def per_forward(forward_batch: ForwardBatch, key, compute):
    """``forward_batch.per_forward(key, compute)``: the cache lives on the forward batch (this
    name stays for engines that call it)."""
    return forward_batch.per_forward(key, compute)


def _checked(hidden_states, forward_batch) -> ResidualStream:
    stream = stream_of(forward_batch)
    stream.check(hidden_states)
    return stream


def check_local_tensor(x, forward_batch, what: str) -> None:
    """Raise unless ``x`` is a tensor with this DP rank's token rows."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a tensor on this DP rank's rows, got {type(x).__name__}")
    facts = forward_batch.row_facts
    if facts is not None and x.shape[0] != facts.local:
        raise ValueError(f"{what} has {x.shape[0]} rows; this DP rank holds {facts.local} tokens")


def complete_output(hidden_states, forward_batch: ForwardBatch):
    """Finish outstanding communication/finalize work; the residual update stays pending.

    Args:
        hidden_states: exactly what the last boundary call returned (a tensor or an
            ``OwedOutput``).
        forward_batch: the batch whose stream holds it.

    Returns the complete output on local rows (the handle to pass on).
    """
    stream = _checked(hidden_states, forward_batch)
    if stream.contribution is None:
        return hidden_states
    facts = forward_batch.row_facts
    return complete_onto(stream, facts, local_rows(facts)).value


def fold_stream(stream: ResidualStream, facts, forward_batch: ForwardBatch) -> torch.Tensor:
    """Complete the pending contribution and apply its update on local rows, in
    ``forward_batch``; the stream is written with that residual, which is also its handle."""
    local = local_rows(facts)
    c = complete_onto(stream, facts, local)
    residual = apply_update(c.update, residual_on(stream, facts, local), c.value, forward_batch)
    stream.write(residual, residual, local)
    return residual


def _fold_token_rows(stream: ResidualStream, facts, forward_batch: ForwardBatch) -> None:
    """Where the stack leaves (the final norm, ``to_pp``), a pending update that needs each DP
    rank's own token rows (``token_rows``: a short convolution) folds in on them first, as a
    consumer's input applies it: the exit applies an update on the residual's rows, which
    ``to_pp`` scatters under rs/rsv. Whatever layer ends the stack or a pipeline stage."""
    c = stream.contribution
    if c is not None and c.update is not PLAIN_ADD and needs_token_rows(c.update):
        fold_stream(stream, facts, forward_batch)


def fold(hidden_states, forward_batch: ForwardBatch) -> torch.Tensor:
    """Complete the pending contribution and fold it into the residual; the stream is
    written.

    Args:
        hidden_states: what the last boundary call returned.
        forward_batch: the batch whose stream holds it.

    Returns the residual on local rows (the handle to pass on).
    """
    stream = _checked(hidden_states, forward_batch)
    if stream.contribution is None:
        return hidden_states
    return fold_stream(stream, forward_batch.row_facts, forward_batch)


def written(hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
    """Replace the stream with a written one whose residual is ``hidden_states``.

    Args:
        hidden_states: the full residual, on this DP rank's local rows (compute that produced
            it itself). Any pending contribution is discarded: fold() first when one may be
            pending.
        forward_batch: the batch whose stream it replaces.

    Returns ``hidden_states`` (the handle to pass on).
    """
    stream = stream_of(forward_batch)
    check_local_tensor(hidden_states, forward_batch, "written()'s hidden_states")
    facts = forward_batch.row_facts
    stream.write(hidden_states, hidden_states, None if facts is None else local_rows(facts))
    return hidden_states


def take_output(hidden_states, forward_batch: ForwardBatch) -> torch.Tensor:
    """Release the stream at a terminal exit whose output is already written.

    Args:
        hidden_states: what the last boundary call returned; nothing may be pending.
        forward_batch: the batch whose stream is released.

    Returns the residual on local rows.
    """
    stream = _checked(hidden_states, forward_batch)
    if stream.contribution is not None:
        raise RuntimeError(PENDING_AT_TAKE)
    out = residual_on(stream, forward_batch.row_facts, local_rows(forward_batch.row_facts))
    release(forward_batch)
    return out


COMPLETED_BEFORE_PP = ("complete_output() before to_pp() completed a sum the receiving "
                      "stage's contract still owes; pass the layer output to to_pp() unchanged")
UNPLACED_AT_PP = ("to_pp() before any stage boundary of this forward ran: the rows the "
                  "receiving stage expects (scattered under rs/rsv) are placed by this "
                  "pipeline rank's boundaries; run its stages before leaving it")
NOT_PORTABLE = ("to_pp(): the pending output's residual update {update!r} does not declare "
                "itself portable, and its declared partial sum crosses the pipeline cut "
                "unreduced, so the receiving stage would apply its own copy of the update; "
                "cut where the producer completes its output, or declare portable = True on an "
                "update whose whole state is its parameters")


def to_pp(hidden_states, forward_batch: ForwardBatch) -> dict:
    """Leave this pipeline rank's part of the stack: the tensors to send to the next stage,
    each on this rank's own rows (where the residual lives in this row mode); the stream is
    released.

    Args:
        hidden_states: what the last boundary call returned, unchanged (no
            ``complete_output()`` before: the receiver may still owe a declared sum).
        forward_batch: the batch whose stream leaves.

    Work the producer's exit decided per batch (a deferred all-reduce, a reduce-scatter, a
    finalize) is completed and its update applied before transport (in this forward batch;
    on the DP rank's own rows where the update needs them, ``token_rows``): ``{"residual"}``. A
    statically declared partial sum (a PARTIAL attention's) crosses unreduced, for the
    receiver's contract to complete: ``{"residual", "partial"}``; its update must be portable
    (the receiver applies its own copy). The residual goes on the rows the receiver's
    declaration expects in this row mode (scattered over attention TP under rs/rsv), also
    where the model folded or wrote it on local rows.
    """
    stream = _checked(hidden_states, forward_batch)
    facts = forward_batch.row_facts
    if facts is None:
        raise RuntimeError(UNPLACED_AT_PP)
    c = stream.contribution
    if c is not None and c.completed_declared:
        raise RuntimeError(COMPLETED_BEFORE_PP)
    if c is not None and c.declared and c.owed is not None and not is_portable(c.update):
        raise RuntimeError(NOT_PORTABLE.format(update=c.update))
    observer = active_observer()
    if observer is not None:
        observer.enter("to_pp")
    if c is not None and not (c.declared and c.owed is not None):
        _fold_token_rows(stream, facts, forward_batch)
        c = stream.contribution
    target = facts.layouts.residual(facts.mode)
    if c is None:
        out = {"residual": residual_on(stream, facts, target)}
    elif c.declared and c.owed is not None:
        # the partial stays on the producer's output rows; the receiver knows which
        out = {"residual": residual_on(stream, facts, target), "partial": c.value}
    else:
        previous = None if stream.residual is None else residual_on(stream, facts, target)
        out = {"residual": apply_update(c.update, previous, completed(c, facts, target),
                                        forward_batch)}
    release(forward_batch)
    return out


def snapshot(hidden_states, forward_batch: ForwardBatch) -> torch.Tensor:
    """An owned residual with the pending update applied, on local rows; the main
    contribution is untouched (its sum, if owed, runs on a copy).

    Args:
        hidden_states: what the last boundary call returned; a pending update must be plain
            and no finalize handoff (``snapshot requires a plain residual update``).
        forward_batch: the batch whose stream holds it.
    """
    stream = _checked(hidden_states, forward_batch)
    facts = forward_batch.row_facts
    c = stream.contribution
    if c is None:
        out = residual_on(stream, facts, local_rows(facts))
        return out.clone() if out is stream.residual else out
    if not is_plain(c.update) or c.handoff:
        raise RuntimeError(SNAPSHOT_NOT_PLAIN)
    local = local_rows(facts)
    value = completed(c, facts, local, value=c.value.clone())
    return apply_update(c.update, residual_on(stream, facts, local), value, forward_batch)


def add_to_output(hidden_states, forward_batch: ForwardBatch, extra: torch.Tensor):
    """Complete the contribution, then add ``extra`` once; the residual update stays pending.

    Args:
        hidden_states: what the last boundary call returned.
        forward_batch: the batch whose stream holds it.
        extra: a [T, D] tensor on this DP rank's local rows (deepstack embeddings, ...),
            added as a plain add: refused on a residual whose update is not plain (mHC).

    Returns the new output on local rows (the handle to pass on).
    """
    stream = _checked(hidden_states, forward_batch)
    check_local_tensor(extra, forward_batch, "add_to_output()'s extra")
    check_extra_joins(stream, EXTRA_NOT_PLAIN)
    facts = forward_batch.row_facts
    local = local_rows(facts)
    if stream.contribution is None:
        return stream.leave(extra, None, PLAIN_ADD, local)
    c = complete_onto(stream, facts, local)
    return stream.leave(c.value + extra, None, c.update, local)


# the owed sums a terminal service completes: its one all-reduce spans the TP group (a
# handoff that owes nothing only where that group is one rank: an all-to-all MoE's combine
# completed it, and a second sum would add it tp times)
_TERMINAL_SUMS = (SumGroup.TP, SumGroup.MOE_OUT)


def _finalize_in_norm(service, c, stream, facts, local, norm_module):
    """The service's fused finalize + sum + add + norm where one all-reduce lands the handoff
    on the residual's own rows (a zero-centered final norm, the residual on local rows, the
    handoff on as many rows); None where it does not apply or the service declines."""
    gamma = getattr(norm_module, "gemma_weight", None)
    if gamma is None or stream.residual is None or facts is None or c.rows is None:
        return None
    sums = c.owed in _TERMINAL_SUMS or (c.owed is None and facts.parallel.tp_group.size == 1)
    if (not sums or stream.residual_rows not in (None, local)
            or facts.count(c.rows) != facts.count(local)):
        return None
    return service.finalize(c.value, stream.residual, gamma)


def norm(hidden_states, forward_batch: ForwardBatch, norm_module, *, skip_empty: bool = False,
         capture_output=None, handoff_norm=None) -> torch.Tensor:
    """Leave the stack: complete owed work, apply the update, apply the final norm; the
    result is on local rows and the stream is released.

    Args:
        hidden_states: what the last boundary call returned.
        forward_batch: the batch whose stream leaves.
        norm_module: the final norm (with ``normalize_fp32`` it runs fused with the add).
        skip_empty: an empty batch still completes owed work (a collective its peers join)
            and skips only the norm kernel.
        capture_output: ``capture(value, owned=False)`` receives the updated residual on
            local rows, always borrowed.
        handoff_norm: a service whose ``finalize(handoff, residual, gamma)`` fuses a
            terminal finalize handoff with the sum, add and norm where it applies
            (``fusions/terminal.py``); with it, ``capture_output`` is refused when a
            handoff arrives.
    """
    stream = _checked(hidden_states, forward_batch)
    observer = active_observer()
    if observer is not None:
        observer.enter("final_norm")
    facts = forward_batch.row_facts
    _fold_token_rows(stream, facts, forward_batch)
    local = local_rows(facts)
    target = stream.residual_rows or local
    c = stream.contribution
    out = None
    if c is None:
        residual = residual_on(stream, facts, target)
    else:
        if handoff_norm is not None and c.handoff and is_plain(c.update):
            if capture_output is not None:
                raise RuntimeError("norm() with handoff_norm does not accept capture_output "
                                   "when a handoff arrives")
            fused = _finalize_in_norm(handoff_norm, c, stream, facts, local, norm_module)
            if fused is not None:
                out, residual = fused
        if out is None:
            value = completed(c, facts, target)
            previous = None if stream.residual is None else residual_on(stream, facts, target)
            if not hasattr(norm_module, "normalize_fp32") or (skip_empty and value.shape[0] == 0):
                residual = apply_update(c.update, previous, value, forward_batch)
            else:
                out, residual = ADD_NORM_READ.update_and_read(
                    in_forward(c.update, forward_batch), previous, value, norm_module)
    if out is None:
        # an empty batch skips the norm kernel, unless the norm changes the residual's shape
        # (mHC's head collapses [T, N, D] streams): its peers gather [T, D] rows
        skip = skip_empty and residual.shape[0] == 0 and residual.dim() == 2
        out = residual if skip else norm_module(residual)
    def to_local(x):
        return x if facts is None else facts.movement(None, target, local).move(facts, x)

    out = to_local(out)
    if capture_output is not None:
        capture_output(to_local(residual), owned=False)
    if observer is not None and facts is not None:
        stream.write(residual, None, target)
        observer.boundary("final_norm", stream, facts)
    release(forward_batch)
    return out
