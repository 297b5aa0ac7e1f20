"""An attention's prepare() with auxiliary captures or an extra residual addition.

``capture_output`` receives the updated residual on local rows (completing the owed
communication unfused first; the add+norm read still runs); ``captured_last_layer_outputs``
receives it on the attention's compute-input rows; ``post_residual_addition`` adds a tensor to
the residual with the producer's output. Every check runs before anything is completed, moved
or captured.
"""

from __future__ import annotations

from .residual import apply_update
from .residual import batch as residual_batch
from .residual.access import complete_onto
from .residual.stream import NOT_OURS, OwedOutput
from .runtime.ledger import active_observer

NOT_PLAIN_ADDITION = "post_residual_addition requires a plain residual update"


def keep(collector, value, owned: bool) -> None:
    """Hand ``value`` to a collector: one with ``capture(value, owned=...)``, or a list (which
    keeps a copy of borrowed storage)."""
    capture = getattr(collector, "capture", None)
    if capture is not None:
        capture(value, owned=owned)
    else:
        collector.append(value if owned else value.clone())


def visible(read, residual):
    """The residual as a model sees it: a read may hold more beside it (mHC's coefficients)."""
    view = getattr(read, "visible", None)
    return residual if view is None else view(residual)


def prepare_capturing(stage, hidden_states, forward_batch, capture_output,
                      captured_last_layer_outputs, post_residual_addition):
    """``stage.prepare(hidden_states, forward_batch, ...)`` with its capture arguments (see
    ``StageBoundary.prepare``)."""
    if not stage.is_attention:
        for name, value in (("capture_output", capture_output),
                            ("captured_last_layer_outputs", captured_last_layer_outputs),
                            ("post_residual_addition", post_residual_addition)):
            if value is not None:
                raise TypeError(f"FFN prepare() does not accept {name}")
    stream, step, facts = stage.turn(hidden_states, forward_batch)
    entry = step.entry
    extra = post_residual_addition
    if extra is not None:
        residual_batch.check_local_tensor(extra, forward_batch, "post_residual_addition")
        if stream.handle is not None:
            residual_batch.check_extra_joins(stream, NOT_PLAIN_ADDITION)
    observer = active_observer()
    if observer is not None:
        observer.enter(stage.sites.prepare)
    captured = False
    if stream.handle is None:  # an initial stream: the input, before enter
        if isinstance(hidden_states, OwedOutput):  # pragma: no cover - turn() refused it
            raise RuntimeError(NOT_OURS)
        if capture_output is not None:
            capture_output(hidden_states, owned=False)
            captured = True
    else:
        c = stream.contribution
        if c is not None and (capture_output is not None or extra is not None):
            # complete the owed communication unfused; the read below still adds and norms
            c = complete_onto(stream, facts, entry.update_rows)
        if capture_output is not None and extra is not None:
            # output plus residual, before the extra addition, back on local rows
            base = entry.residual(stream, facts)
            value = base.clone() if c is None else apply_update(c.update, base, c.value,
                                                                forward_batch)
            capture_output(entry.capture_move.move(facts, value), owned=True)
            captured = True
    compute_input = entry.enter(stream, hidden_states, facts, forward_batch, extra=extra,
                                fused=capture_output is None)
    if capture_output is not None and not captured:
        # the updated residual, back on the producer's (local) rows
        capture_output(visible(entry.read, entry.capture_move.move(facts, stream.residual)),
                       owned=entry.capture_move.allocates)
    if captured_last_layer_outputs is not None:
        keep(captured_last_layer_outputs,
             visible(entry.read, entry.input_move.move(facts, stream.residual)),
             entry.input_move.allocates)
    stream.begin(stage, step, compute_input)
    if observer is not None:
        observer.boundary(stage.sites.prepare, stream, facts)
        observer.enter(stage.sites.compute)
    return compute_input
