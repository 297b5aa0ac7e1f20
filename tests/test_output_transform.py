"""``OutputTransform``: contribution processing before the residual update, in both declared
orders, on real gloo ranks against world 1 with the transform applied by hand.

The world-1 reference declares nothing and applies ``fn`` in the model to compute's output,
which at world 1 is already complete: after the sum, by construction. The declared stacks
must give the same numbers on every row mode. The after-the-sum transform is a soft cap
(nonlinear): run on partials before their sum it gives other numbers, so these cases fail if
the boundary applies it at the wrong place, or lets a fused add+norm skip it. The
before-the-sum one is a scale (linear), applied to each rank's partial at the exit.
"""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, DpBatch, ToyAttn, ToyFfn, runtime, seeded, toy_norm

from layer_boundary import OutputTransform, declare_attn, declare_ffn, layer_stack, make_stages
from layer_boundary.construction import UnsupportedBoundary
from layer_boundary.residual import batch as residual_batch


def _softcap(x):
    return 3.0 * torch.tanh(x / 3.0)


def _half(x):
    return 0.5 * x


SOFTCAP = OutputTransform(_softcap, before_reduce_scatter=False)
HALF = OutputTransform(_half, before_reduce_scatter=True)
LAYERS = 3


def run(tp: int, dp: int, policy: str, counts, attn_t, ffn_t, by_hand: bool = False,
        fusions: str | None = None, scheduled: bool = False) -> dict:
    """The stack's output on this rank; ``scheduled``: the FFNs publish through
    ``postprocess()`` (compute completes its own sum, outside any exit scope)."""
    rt = runtime(tp, dp, boundary_reduction=policy)
    par = rt.parallel
    options = {}
    if fusions == "reference":
        from layer_boundary.fusions.reference import ReferenceFusions

        options = {"fusions": ReferenceFusions()}
    declared = (None, None) if by_hand else (attn_t, ffn_t)
    ffn_decl = declare_ffn(output_transform=declared[1])
    stages = []
    with layer_stack(rt):
        for i in range(LAYERS):
            stages += make_stages(
                (declare_attn(output_transform=declared[0]), toy_norm(10 + i), options),
                (ffn_decl, toy_norm(20 + i), options), previous=ffn_decl if i else None,
                terminal=i == LAYERS - 1, runtime=rt, name=f"layer{i}")
    attn = [ToyAttn(par, 100 + i) for i in range(LAYERS)]
    ffn = [ToyFfn(par, 200 + i) for i in range(LAYERS)]
    b = DpBatch(counts, rt)
    residual_batch.start(b.fb)
    h = b.mine(seeded((sum(counts), HIDDEN), 5))
    for i in range(LAYERS):
        a, f = stages[2 * i], stages[2 * i + 1]
        x = a.prepare(h, b.fb)
        y = attn[i](x)
        h = a.finish(attn_t(y) if by_hand else y, b.fb)
        x = f.prepare(h, b.fb)
        if scheduled:
            y = ffn[i](x)
            h = f.postprocess(ffn_t(y) if by_hand else y, b.fb)
            continue
        with f.exit(b.fb) as out:
            y = ffn[i](x)
        h = out.finish(ffn_t(y) if by_hand else y)
    out = residual_batch.norm(h, b.fb, toy_norm(99))
    return {"out": out, "rows": (b.rows.start, b.rows.stop)}


# (tp, dp, policy, DP token counts): every row mode, attention DP with an empty DP rank
CASES = [(2, 1, "ar", (5,)), (2, 1, "rs", (5,)), (4, 2, "rsv", (5, 3)), (4, 2, "rs", (0, 5)),
         (4, 4, "ar", (2, 0, 3, 1))]
ORDERS = {"softcap-attn-half-ffn": (SOFTCAP, HALF), "half-attn-softcap-ffn": (HALF, SOFTCAP)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("tp,dp,policy,counts", CASES, ids=[
    f"tp{t}-dp{d}-{p}-{'_'.join(map(str, c))}" for t, d, p, c in CASES])
def test_both_orders_match_the_transform_applied_by_hand(order, tp, dp, policy, counts):
    attn_t, ffn_t = ORDERS[order]
    ref = run(1, 1, "ar", counts, attn_t, ffn_t, by_hand=True)
    for rank, r in enumerate(get_pool(tp).run(run, tp, dp, policy, counts, attn_t, ffn_t)):
        torch.testing.assert_close(r["out"], ref["out"][slice(*r["rows"])], atol=1e-5, rtol=0,
                                   msg=lambda m: f"rank {rank}: {m}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("tp,dp,policy,counts", [(2, 1, "rs", (5,)), (4, 2, "rsv", (0, 5))],
                         ids=["tp2-rs", "tp4-dp2-rsv-empty"])
def test_postprocess_applies_both_orders(order, tp, dp, policy, counts):
    attn_t, ffn_t = ORDERS[order]
    ref = run(1, 1, "ar", counts, attn_t, ffn_t, by_hand=True, scheduled=True)
    for r in get_pool(tp).run(run, tp, dp, policy, counts, attn_t, ffn_t, scheduled=True):
        torch.testing.assert_close(r["out"], ref["out"][slice(*r["rows"])], atol=1e-5, rtol=0)


@pytest.mark.timeout(120)
def test_fused_candidates_never_skip_an_after_sum_transform():
    """The reference provider's fused finalize + all-reduce + add + norm completes plain
    updates only; after a transformed output the input runs unfused."""
    ref = run(1, 1, "ar", (5,), SOFTCAP, SOFTCAP, by_hand=True)
    for r in get_pool(2).run(run, 2, 1, "ar", (5,), SOFTCAP, SOFTCAP, fusions="reference"):
        torch.testing.assert_close(r["out"], ref["out"][slice(*r["rows"])], atol=1e-5, rtol=0)


def test_the_declaration_states_its_order():
    decl = declare_ffn(output_transform=SOFTCAP)
    assert decl.residual.update != declare_ffn().residual.update  # folded into the update
    assert declare_ffn(output_transform=SOFTCAP) == decl  # one stage, declared twice
    before = declare_ffn(output_transform=HALF)
    assert before.residual.update == declare_ffn().residual.update  # run at the exit
    assert "before the sum" in repr(HALF) and "after the sum" in repr(SOFTCAP)
    with pytest.raises(TypeError, match="^output_transform must be an OutputTransform"):
        declare_ffn(output_transform=_half)
    with pytest.raises(UnsupportedBoundary, match="a branch's entry stage takes no "
                                                  "output_transform"):
        source = declare_ffn()
        make_stages((declare_ffn(output_transform=HALF), toy_norm(0)), prepared_from=source,
                    runtime=runtime(), name="branch", terminal=True)
