"""LOCAL_TAIL: an FFN that adds a replicated tail after its internal sum. The boundary never
defers that sum by default; when compute skips it (reduce-scatter, or a provider that lets
it defer), compute must add the tail exactly once, and the numbers show whether it did."""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, ToyLayer, batch, runtime

from layer_boundary import ProducerReduction
from layer_boundary.fusions.reference import ReferenceFusions
from layer_boundary.runtime.collectives import all_reduce_rows
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime.ledger import LEDGER
from layer_boundary.runtime.norm import RMSNorm

LAYERS = 3
TAIL = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(11)) * 0.3


def tail_ffn(layer, x, scope, tail_on_every_rank=False):
    """Routed part as a partial sum over TP, then a replicated tail (a TP-1 shared expert)."""
    partial = layer.ffn_compute(x)
    tail = torch.tanh(x) @ TAIL
    if not scope.skips_reduction:
        return all_reduce_rows(partial, layer.down.group) + tail
    once = tail_on_every_rank or layer.down.group.rank == 0
    return partial + tail if once else partial


def stack(tp: int, policy: str, provider: bool, tail_on_every_rank: bool = False) -> dict:
    rt = runtime(tp, boundary_reduction=policy)
    fusions = ReferenceFusions(defer_all_reduce=True) if provider else None
    layers = [ToyLayer(rt, i, LAYERS, ffn_reduction=ProducerReduction.LOCAL_TAIL,
                       fusions=fusions) for i in range(LAYERS)]
    for layer in layers:
        layer.down.reduce_results = False  # this compute owns its sum (see tail_ffn)
    fb = batch(4)
    residual_batch.start(fb)
    h = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(3))
    skipped = []
    with LEDGER.recording() as ledger:
        for layer in layers:
            h = layer.attn.prepare(h, fb)
            h = layer.attn.finish(layer.attn_compute(h), fb)
            h = layer.ffn.prepare(h, fb)
            with layer.ffn.exit(fb) as scope:
                y = tail_ffn(layer, h, scope, tail_on_every_rank)
            skipped.append(scope.skips_reduction)
            h = scope.finish(y)
        out = residual_batch.norm(h, fb, RMSNorm(HIDDEN))
    return {"out": out, "skipped": skipped, "mode": fb.rows.mode.value,
            "sums": [e.site for e in ledger
                     if e.group == "tp" and e.kind in ("all_reduce", "reduce_scatter")]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy,provider,skips", [
    ("ar", False, [False, False, False]),  # never deferred without a provider
    ("ar", True, [True, True, False]),  # the provider lets non-terminal ones defer
    # reduce-scatter permission is kept, at the end too (the final norm reduce-scatters)
    ("rs", False, [True, True, True]),
])
def test_local_tail_added_once(policy, provider, skips):
    ref = stack(1, "ar", False)["out"]
    for r in get_pool(2).run(stack, 2, policy, provider):
        assert r["skipped"] == skips
        torch.testing.assert_close(r["out"], ref, atol=1e-5, rtol=0)
        assert len(r["sums"]) == LAYERS  # one TP sum per FFN output


@pytest.mark.timeout(60)
def test_a_tail_added_on_every_rank_is_caught():
    ref = stack(1, "ar", False)["out"]
    for r in get_pool(2).run(stack, 2, "rs", False, True):
        assert (r["out"] - ref).abs().max() > 1e-3
