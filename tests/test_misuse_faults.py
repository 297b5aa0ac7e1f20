"""Library misuse that would otherwise hang in a collective or return wrong rows: DP token
counts that do not describe the batch, counts changed inside a forward, stages of two runtimes
in one forward, a stage output of the wrong dtype. Each raises an error naming the misuse."""

from __future__ import annotations

import pytest
import torch
from toy import HIDDEN, ToyStack, runtime, seeded

from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime import ForwardBatch, ForwardMode


def _batch(tokens=3, counts=None):
    return ForwardBatch.build(ForwardMode.EXTEND, [list(range(tokens))], [0],
                              dp_token_counts=counts)


def test_counts_that_do_not_describe_the_batch_raise_before_any_collective():
    stack = ToyStack(runtime(), layers=2)
    fb = _batch(3, counts=(5,))
    residual_batch.start(fb)
    with pytest.raises(ValueError, match=r"ForwardBatch.dp_token_counts \(5,\) does not "
                                         r"describe this rank: .* holds 3 tokens"):
        stack.layers[0].attn_half(seeded((3, HIDDEN), 1), fb)


def test_counts_changed_inside_a_forward_raise():
    stack = ToyStack(runtime(), layers=2)
    fb = _batch(3)
    residual_batch.start(fb)
    h = stack.layers[0].attn_half(seeded((3, HIDDEN), 1), fb)
    fb.dp_token_counts = (4,)
    with pytest.raises(ValueError, match=r"dp_token_counts changed to \(4,\) inside a forward "
                                         r"whose rows were placed for \(3,\)"):
        stack.layers[0].ffn_half(h, fb)


def test_stages_of_two_runtimes_in_one_forward_raise():
    first, second = ToyStack(runtime(), layers=2), ToyStack(runtime(), layers=2)
    fb = _batch(3)
    residual_batch.start(fb)
    h = first.layers[0].attn_half(seeded((3, HIDDEN), 1), fb)
    with pytest.raises(ValueError, match="stage layer0.ffn was built on another runtime than "
                                         "the stages this forward already ran"):
        second.layers[0].ffn_half(h, fb)


def test_a_stage_output_of_the_wrong_dtype_raises():
    stack = ToyStack(runtime(), layers=2)
    layer = stack.layers[0]
    fb = _batch(3)
    residual_batch.start(fb)
    x = layer.attn.prepare(seeded((3, HIDDEN), 1), fb)
    with pytest.raises(TypeError, match="stage layer0.attn returned a torch.float64 output; "
                                        "the residual stream holds torch.float32"):
        layer.attn.finish(layer.attn_compute(x).double(), fb)
    fb = _batch(3)
    residual_batch.start(fb)
    h = layer.ffn.prepare(layer.attn_half(seeded((3, HIDDEN), 1), fb), fb)
    with pytest.raises(TypeError, match="stage layer0.ffn returned a torch.bfloat16 output"):
        with layer.ffn.exit(fb) as out:
            y = layer.ffn_compute(h).to(torch.bfloat16)
        out.finish(y)
