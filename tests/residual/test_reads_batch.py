"""An update that declares it reads its batch (``reads_batch``) is handed the forward batch it
is applied in, by whoever applies it: a consumer's input, the final norm, ``to_pp``, and, under
two-batch overlap, each microbatch's own (its final norm runs after the other microbatch's last
layer). An outside update of two arguments runs beside it unchanged; an update whose ``apply``
cannot take what it will be handed is refused at declaration, by name. What such an update
reads of its forward, each request with its rows (``ForwardBatch.requests()``) and whether it
is a decode step, is one walk on the batch. World 1."""

from __future__ import annotations

import pytest
import torch
from toy import HIDDEN, ToyStack, runtime, seeded

from layer_boundary import declare_attn, declare_ffn, run_two_batches
from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual.short_conv import ShortConv, ShortConvUpdate
from layer_boundary.runtime import ForwardBatch, ForwardMode, TwoBatch
from layer_boundary.runtime.forward_batch import BatchRequest

REQUESTS = [[1, 2, 3], [4, 5]]


class Halved:
    """An outside update of two arguments: ``residual + contribution / 2`` (not plain)."""

    plain = False
    at_producer = False

    def apply(self, residual, contribution):
        return contribution / 2 if residual is None else residual + contribution / 2


class Reading:
    """The add, recording the forward it is handed with the rows it adds."""

    plain = False
    at_producer = False
    reads_batch = True

    def __init__(self) -> None:
        self.seen: list = []

    def apply(self, residual, contribution, forward):
        self.seen.append((forward, contribution.shape[0]))
        return contribution if residual is None else residual + contribution


def _stack():
    reading = Reading()
    return ToyStack(runtime(), layers=2, attn_update=Halved(), ffn_update=reading), reading


def _by_hand(stack, x):
    """The stack's residual before the final norm, in plain torch."""
    h = x
    for layer in stack.layers:
        h = h + layer.attn_compute(layer.attn_norm(h)) / 2
        h = h + layer.ffn_compute(layer.ffn_norm(h))
    return h


def _batch() -> ForwardBatch:
    return ForwardBatch.build(ForwardMode.EXTEND, REQUESTS, [0, 0])


def _run(stack, fb, x, leave):
    residual_batch.start(fb)
    h = x
    for layer in stack.layers:
        h = layer.forward_layer(h, fb)
    return leave(h, fb)


def test_it_is_handed_the_forward_it_runs_in_and_a_two_argument_update_runs_beside_it():
    stack, reading = _stack()
    x = seeded((5, HIDDEN), 1)
    with torch.no_grad():
        fb = _batch()
        out = _run(stack, fb, x, stack.final)
        expected = _by_hand(stack, x)
        torch.testing.assert_close(out, stack.final_norm(expected), atol=1e-5, rtol=0)
        # the second layer's input and the final norm applied it, each in this forward
        assert reading.seen == [(fb, 5), (fb, 5)]
        reading.seen.clear()
        fb = _batch()
        sent = _run(stack, fb, x, residual_batch.to_pp)
        torch.testing.assert_close(sent["residual"], expected, atol=1e-5, rtol=0)
        assert set(sent) == {"residual"} and reading.seen == [(fb, 5), (fb, 5)]
        reading.seen.clear()
        # two microbatches, interleaved layer by layer: each application its own microbatch
        fb = _batch()
        fb.two_batch = TwoBatch.SYNCHRONOUS
        out = run_two_batches(fb, x, 0, stack.layers, lambda layer, h, mb:
                              layer.forward_layer(h, mb), stack.final)
    torch.testing.assert_close(out, stack.final_norm(expected), atol=1e-5, rtol=0)
    first, second = fb.boundary.microbatches
    assert [(id(f), n) for f, n in reading.seen] == [(id(first), 3), (id(second), 2)] * 2


class TwoArguments:
    reads_batch = True
    plain = False

    def apply(self, residual, contribution):
        return residual + contribution


class PlainReading(Reading):
    plain = True
    reads_batch = True


class RenamedConv(ShortConvUpdate):
    """Keeps the three-argument apply, but not the declaration: a capability is never
    inherited."""


@pytest.mark.parametrize("make,said", [
    (TwoArguments, r"it declares reads_batch, so its apply is handed \(residual, contribution, "
                   r"forward\); its apply takes \(residual, contribution\)"),
    (PlainReading, "it declares reads_batch and plain: a fused add"),
    (lambda: RenamedConv(ShortConv(HIDDEN, 2), name="layer0.attn_sconv"),
     r"its apply\(residual: .*, forward\) -> .* takes more than \(residual, contribution\); "
     "an update that reads its batch declares reads_batch = True on its own class"),
], ids=["two-arguments", "plain", "inherited"])
def test_an_apply_that_cannot_take_what_it_is_handed_is_refused_at_declaration(make, said):
    update = make()
    for declare in (declare_attn, declare_ffn):
        with pytest.raises(TypeError, match=rf"^{declare.__name__}\(update=.*\): {said}"):
            declare(update=update)


def test_a_batch_walks_its_requests_with_their_rows():
    fb = ForwardBatch.build(ForwardMode.EXTEND, [[1, 2, 3], [], [4, 5]], [0, 4, 2],
                            req_slots=[5, 0, 2])
    assert fb.requests() == (BatchRequest(0, 5, 0, 3, 0, 3), BatchRequest(1, 0, 4, 0, 3, 3),
                             BatchRequest(2, 2, 2, 2, 3, 5))
    assert fb.requests()[2].prefix == 2 and fb.requests()[2].start == 3
    assert not fb.decode_step  # a prompt among them
    step = ForwardBatch.build(ForwardMode.DECODE, [[1], [2]], [3, 1])
    assert step.decode_step and [r.end for r in step.requests()] == [1, 2]
    assert not ForwardBatch.build(ForwardMode.EXTEND, [[1]], [0]).decode_step  # no prefix
