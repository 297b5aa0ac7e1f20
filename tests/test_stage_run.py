"""``StageBoundary.run``: prepare, compute inside the exit scope and finish in one call.

Its plain path writes the three calls out, so it is held to them: the same numbers and the
same collectives as ``prepare()`` / ``exit()`` / ``finish()`` on every row mode (with
attention DP and a DP rank without tokens), the scope's flags, adapter rows and open-scope
count inside compute, and the same refusals when compute misbehaves.
"""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, DpBatch, ToyHandoff, ToyLayer, batch, runtime, toy_norm

from layer_boundary import layer_stack
from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual.stream import NOT_OURS
from layer_boundary.runtime import collectives
from layer_boundary.runtime.context import (NO_ADAPTERS, NO_FLAGS, adapter_rows, get_forward,
                                            open_exit_scopes)

LAYERS = 3
COUNTS = (5, 0)  # the second DP rank holds no tokens


def _attn(layer):
    return lambda x, fb: layer.attn_compute(x)


def _ffn(layer):
    return lambda x, fb: layer.ffn_compute(x)


def _forward(rt, counts, through_run: bool, tokens=None):
    """The toy stack over ``counts`` (a DP rank's segment of the same tokens), each stage
    through ``run`` or through the three calls; (output, the collectives issued)."""
    with layer_stack(rt):
        layers = [ToyLayer(rt, i, LAYERS) for i in range(LAYERS)]
    final = toy_norm(300)
    dp = DpBatch(counts, rt)
    fb = dp.fb
    issued = []
    observe = collectives._observe

    def counting(kind, group, numel, dtype, site, wire_numel=None, wire_kind=None):
        issued.append((kind, group.name, numel))
        return observe(kind, group, numel, dtype, site, wire_numel, wire_kind)

    collectives._observe = counting
    try:
        residual_batch.start(fb)
        full = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(3))
        h = dp.mine(full)
        for layer in layers:
            if through_run:
                h = layer.attn.run(h, fb, _attn(layer))
                h = layer.ffn.run(h, fb, _ffn(layer))
            else:
                h = layer.forward_layer(h, fb)
        out = residual_batch.norm(h, fb, final)
    finally:
        collectives._observe = observe
    return out, issued


def run_case(tp: int, dp: int, policy: str, counts, fusion: bool):
    rt = runtime(tp, dp, boundary_reduction=policy, allreduce_fusion=fusion)
    return _forward(rt, counts, True), _forward(rt, counts, False)


CASES = [(2, 1, "ar", (5,)), (2, 1, "rs", (5,)), (2, 1, "rsv", (5,)),
         (2, 2, "ar", COUNTS), (2, 2, "rs", COUNTS), (2, 2, "rsv", COUNTS)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fusion", [True, False], ids=["deferred", "in-compute"])
@pytest.mark.parametrize("tp,dp,policy,counts", CASES,
                         ids=[f"tp{t}-dp{d}-{p}" for t, d, p, _ in CASES])
def test_run_matches_the_three_calls_and_world1(tp, dp, policy, counts, fusion):
    ref, _ = _forward(runtime(), (sum(counts),), True)
    ref_calls, _ = _forward(runtime(), (sum(counts),), False)
    torch.testing.assert_close(ref, ref_calls, atol=0, rtol=0)
    for rank, ((out, issued), (out_calls, issued_calls)) in enumerate(
            get_pool(tp).run(run_case, tp, dp, policy, counts, fusion)):
        # the same tensors and the same collectives, in the same order, as the three calls
        torch.testing.assert_close(out, out_calls, atol=0, rtol=0)
        assert issued == issued_calls and issued
        d = rank // (tp // dp) if dp > 1 else 0
        rows = slice(sum(counts[:d]), sum(counts[:d + 1])) if dp > 1 else slice(None)
        torch.testing.assert_close(out, ref[rows], atol=1e-5, rtol=0)


def _prepared():
    """A world-1 toy stack started, with its first attention published."""
    rt = runtime()
    with layer_stack(rt):
        layers = [ToyLayer(rt, i, LAYERS) for i in range(LAYERS)]
    fb = batch()
    residual_batch.start(fb)
    h = layers[0].attn.run(torch.ones(fb.num_tokens, HIDDEN), fb, _attn(layers[0]))
    return layers[0], fb, h


def flags_case(fusion: bool):
    rt = runtime(2, allreduce_fusion=fusion)
    with layer_stack(rt):
        layers = [ToyLayer(rt, i, 2) for i in range(2)]
    fb = batch()
    residual_batch.start(fb)
    h = layers[0].attn.run(torch.ones(fb.num_tokens, HIDDEN), fb, _attn(layers[0]))
    seen = {}

    def ffn(x, fb):
        seen["flags"], seen["open"] = get_forward(), open_exit_scopes()
        seen["adapters"] = adapter_rows()
        return layers[0].ffn_compute(x)

    layers[0].ffn.run(h, fb, ffn)
    return (seen["flags"].fuse_mlp_allreduce, seen["open"], seen["adapters"] is NO_ADAPTERS,
            get_forward() is NO_FLAGS, open_exit_scopes(), adapter_rows())


@pytest.mark.timeout(60)
def test_compute_sees_the_scope_and_it_is_restored():
    for fusion in (True, False):
        for result in get_pool(2).run(flags_case, fusion):
            # inside: the exit's flags, one open scope, no adapters; after: all restored
            assert result == (fusion, 1, True, True, 0, None)


def test_a_raising_compute_restores_the_scope_and_ends_the_stream():
    layer, fb, h = _prepared()

    def broken(x, fb):
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        layer.ffn.run(h, fb, broken)
    assert get_forward() is NO_FLAGS and open_exit_scopes() == 0 and adapter_rows() is None
    # the stage never published: what the model held is not the stream's any more
    with pytest.raises(RuntimeError, match=f"^{NOT_OURS}$"):
        layer.ffn.prepare(h, fb)
    with pytest.raises(RuntimeError, match="exit\\(\\) on stage layer0.ffn without its prepare"):
        layer.ffn.exit(fb)


def test_run_refuses_what_finish_refuses():
    layer, fb, h = _prepared()
    with pytest.raises(TypeError, match="returned a torch.float64 output; the residual stream "
                                        "holds torch.float32"):
        layer.ffn.run(h, fb, lambda x, fb: layer.ffn_compute(x).double())
    layer, fb, h = _prepared()
    with pytest.raises(RuntimeError, match="did not publish defer_moe_finalize"):
        layer.ffn.run(h, fb, lambda x, fb: ToyHandoff(layer.ffn_compute(x)))


def test_a_nested_boundary_call_inside_compute_is_refused():
    layer, fb, h = _prepared()

    def publishes_itself(x, fb):
        return layer.ffn.run(h, fb, _ffn(layer))

    with pytest.raises(RuntimeError, match=f"^{NOT_OURS}$"):
        layer.ffn.run(h, fb, publishes_itself)
