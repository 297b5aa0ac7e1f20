"""Auxiliary capture: attention prepare captures the stack input at entry and the updated
residual (on the producer's local rows, gathered if scattered) afterwards; the final norm
captures its updated residual. Checked on 2 gloo ranks against world 1, ar and rs."""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, ToyLayer, batch, runtime

from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime.norm import RMSNorm


class Collector:
    def __init__(self) -> None:
        self.values, self.owned = [], []

    def capture(self, value, *, owned=False):
        self.values.append(value if owned else value.clone())  # borrowed: copy before keeping
        self.owned.append(owned)


def captured(tp: int, policy: str) -> dict:
    rt = runtime(tp, boundary_reduction=policy)
    layers = [ToyLayer(rt, i, 3) for i in range(3)]
    fb = batch(5)
    residual_batch.start(fb)
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(6))
    collector = Collector()
    for layer in layers:
        h = layer.attn.prepare(h, fb, capture_output=collector.capture)
        h = layer.attn.finish(layer.attn_compute(h), fb)
        h = layer.ffn.prepare(h, fb)
        with layer.ffn.exit(fb) as out:
            y = layer.ffn_compute(h)
        h = out.finish(y)
    residual_batch.norm(h, fb, RMSNorm(HIDDEN), capture_output=collector.capture)
    return {"values": collector.values, "owned": collector.owned, "mode": fb.rows.mode.value}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["ar", "rs"])
def test_captures_match_world1(policy):
    ref = captured(1, "ar")
    assert len(ref["values"]) == 4  # the input at entry, two updated residuals, the final one
    for r in get_pool(2).run(captured, 2, policy):
        assert r["mode"] == policy
        for got, want in zip(r["values"], ref["values"]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        # a gathered residual is fresh storage; a local one is borrowed; the final norm's
        # capture is always borrowed
        assert r["owned"][1:] == [policy == "rs"] * 2 + [False]


def test_ffn_prepare_does_not_take_capture_output():
    layer, fb = ToyLayer(runtime(), 0, 1), batch()
    residual_batch.start(fb)
    h = layer.attn.prepare(torch.ones(3, HIDDEN), fb)
    h = layer.attn.finish(h, fb)
    with pytest.raises(TypeError, match="FFN prepare\\(\\) does not accept capture_output"):
        layer.ffn.prepare(h, fb, capture_output=Collector().capture)
