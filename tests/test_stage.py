"""A toy decoder stack through StageBoundary on 2 gloo ranks against world 1, with the plain
update and with a nonlinear one (which must be applied only after the owed sum completes)."""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from test_errors import ScaledUpdate
from toy import HIDDEN, ToyLayer, batch, runtime

from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime.norm import RMSNorm

LAYERS = 3


def stack(tp: int, nonlinear: bool, allreduce_fusion: bool) -> torch.Tensor:
    rt = runtime(tp, allreduce_fusion=allreduce_fusion)
    update = ScaledUpdate() if nonlinear else None
    layers = [ToyLayer(rt, i, LAYERS, ffn_update=update) for i in range(LAYERS)]
    fb = batch(5)
    residual_batch.start(fb)
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(5))
    for layer in layers:
        h = layer.forward_layer(h, fb)
    return residual_batch.norm(h, fb, RMSNorm(HIDDEN))


def test_nonlinear_update_changes_the_result():
    # guards the parity test below against an update that is silently ignored
    assert (stack(1, True, True) - stack(1, False, True)).abs().max() > 1e-2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nonlinear", [False, True], ids=["plain", "nonlinear"])
@pytest.mark.parametrize("allreduce_fusion", [True, False], ids=["deferred", "in-compute"])
def test_toy_stack_matches_world1(nonlinear, allreduce_fusion):
    ref = stack(1, nonlinear, allreduce_fusion)
    for out in get_pool(2).run(stack, 2, nonlinear, allreduce_fusion):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
