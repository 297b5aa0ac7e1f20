"""Split prefill at world 1: a prefill run as layer-range segments equals the one-call prefill;
the stream starts only in the segment that runs the first layer and leaves only in the last,
and segments out of order are refused."""

from __future__ import annotations

import pytest
import torch

from layer_boundary.models import load_model
from layer_boundary.residual.stream import START_FIRST
from layer_boundary.runtime.args import BoundaryRuntime
from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode
from layer_boundary.runtime.parallel import ParallelDims, build_parallel

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


@pytest.fixture(scope="module")
def model(qwen3_dir):
    return load_model(qwen3_dir, BoundaryRuntime(build_parallel(ParallelDims())))


def batch(model):
    return ForwardBatch.build(ForwardMode.EXTEND, PROMPTS, [0, 0],
                              kv_cache=model.make_kv_cache(2, 8))


@torch.no_grad()
def test_segments_equal_one_call(model):
    whole = model(batch(model))
    fb = batch(model)
    outs = []
    for segment in ((0, 1), (1, 2), (2, 3)):
        fb.layer_segment = segment
        outs.append(model(fb))
    assert outs[0] is None and outs[1] is None  # the stack has not left yet
    assert fb.residual_stream is None  # the last segment released it
    torch.testing.assert_close(outs[2], whole, atol=0, rtol=0)


@torch.no_grad()
def test_segments_out_of_order_are_refused(model):
    fb = batch(model)
    fb.layer_segment = (1, 3)
    with pytest.raises(RuntimeError, match=f"^{START_FIRST}$"):
        model(fb)
    fb = batch(model)
    fb.layer_segment = (0, 1)
    model(fb)
    fb.layer_segment = (2, 3)
    with pytest.raises(RuntimeError, match=r"layer segment \[2, 3\) does not continue the "
                                           "previous segment, which ended at layer 1"):
        model(fb)
    fb.layer_segment = (0, 4)
    with pytest.raises(ValueError, match=r"layer segment \[0, 4\) is not inside this pipeline "
                                         r"stage's layers \[0, 3\)"):
        model(fb)
