"""The scaled residual kind (residual/scaled.py) through the boundaries.

A toy stack whose attention and FFN producers declare ``ScaledAdd`` with two different
multipliers. World 1 equals the same layers written out in plain torch (``h = h + m *
compute(norm(h))``); multi-rank runs (ar, rs, rsv, attention DP, an empty DP rank) equal world
1, through the final norm and through the accessors (a capture of layer 1's updated residual;
a snapshot and an extra refused); the update never moves before a sum and the reference
provider's candidates, offered, never stand in for it; being portable, it crosses a pipeline
cut after a PARTIAL attention with the declared sum and the update pending. The add+norm read
forms the scaled sum in fp32 and rounds it once; a subclass inherits none of that.
"""

from __future__ import annotations

import re

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, DpBatch, ToyLayer, runtime, seeded, toy_norm

from layer_boundary.fusions import Arrival, Declined
from layer_boundary.fusions.reference import ReferenceFusions, finalize_all_reduce_add_norm
from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual import is_plain, is_portable
from layer_boundary.residual.add_norm import ADD_NORM_READ
from layer_boundary.residual.batch import EXTRA_NOT_PLAIN, SNAPSHOT_NOT_PLAIN
from layer_boundary.residual.scaled import ScaledAdd, scaled_update
from layer_boundary.runtime import (LEDGER, BoundaryRuntime, ParallelDims, build_parallel,
                                    recv_from_prev_stage, send_to_next_stage)

LAYERS = 3
M_ATTN, M_FFN = 0.25, 1.75  # distinct, so an update applied by the wrong stage shows
SUMS = ("all_reduce", "reduce_scatter")


def stack(rt, fusions=None):
    return [ToyLayer(rt, i, LAYERS, attn_update=ScaledAdd(M_ATTN), ffn_update=ScaledAdd(M_FFN),
                     fusions=fusions) for i in range(LAYERS)], toy_norm(300)


def by_hand(x: torch.Tensor) -> torch.Tensor:
    """The world-1 stack in plain torch, transformers' Granite order: h = h + compute * m."""
    layers, final = stack(runtime())
    h = x
    with torch.no_grad():
        for layer in layers:
            h = h + layer.attn_compute(layer.attn_norm(h)) * M_ATTN
            h = h + layer.ffn_compute(layer.ffn_norm(h)) * M_FFN
        return final(h)


def through(layers, h, fb, accessors: bool):
    """The layers over ``h``; with ``accessors``, layer 1's updated residual captured at its
    attention's input, then a snapshot and an extra tried. Returns (h, captured, refusals)."""
    captured, refused = [], []
    for i, layer in enumerate(layers):
        kwargs = ({"capture_output": lambda v, owned: captured.append(v.clone())}
                  if accessors and i == 1 else {})
        h = layer.ffn_half(layer.attn_half(h, fb, **kwargs), fb)
    if accessors:
        for attempt in (lambda: residual_batch.snapshot(h, fb),
                        lambda: residual_batch.add_to_output(h, fb, torch.zeros_like(captured[0]))):
            try:
                attempt()
            except RuntimeError as e:
                refused.append(str(e))
    return h, captured, refused


def run(tp: int, dp: int, policy: str, counts, accessors: bool = False,
        fusions: bool = False) -> dict:
    rt = runtime(tp, dp, boundary_reduction=policy)
    provider = ReferenceFusions() if fusions else None
    layers, final = stack(rt, provider)
    b = DpBatch(counts, rt)
    residual_batch.start(b.fb)
    h = b.mine(seeded((sum(counts), HIDDEN), 8))
    with LEDGER.recording() as ledger:
        h, captured, refused = through(layers, h, b.fb, accessors)
        out = residual_batch.norm(h, b.fb, final)
    mode = b.fb.rows.mode
    return {"out": out, "rows": (b.rows.start, b.rows.stop), "mode": mode.value,
            "released": b.fb.residual_stream is None, "captured": captured, "refused": refused,
            "sums": [(e.kind, e.group, e.site) for e in ledger if e.kind in SUMS],
            "offered": len(provider.candidates) if provider else 0,
            "accepted": provider.accepted if provider else 0,
            "ffn_entry": layers[-1].ffn.describe(mode)["entry"]}


def mine(r, full):
    return full[slice(*r["rows"])]


def test_world1_is_the_scaled_add_written_out():
    r = run(1, 1, "ar", (6,))
    torch.testing.assert_close(r["out"], by_hand(seeded((6, HIDDEN), 8)), atol=1e-6, rtol=0)
    assert r["released"]


# (tp, dp, policy, counts, accessors); dp 2 with (3, 0): a DP rank with no tokens
CASES = [(2, 1, "ar", (5,), True), (2, 1, "rs", (5,), False), (4, 2, "rsv", (3, 0), True),
         (4, 2, "rs", (2, 5), False)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy,counts,accessors", CASES,
                         ids=[f"tp{t}-dp{d}-{p}" + ("-accessors" if a else "")
                              for t, d, p, _, a in CASES])
def test_every_row_mode_matches_world1(tp, dp, policy, counts, accessors):
    ref = run(1, 1, "ar", counts, accessors)
    for rank, r in enumerate(get_pool(tp).run(run, tp, dp, policy, counts, accessors)):
        assert r["mode"] == policy and r["released"]
        torch.testing.assert_close(r["out"], mine(r, ref["out"]), atol=1e-5, rtol=0,
                                   msg=lambda m: f"rank {rank}: {m}")
        if accessors:
            assert r["refused"] == [SNAPSHOT_NOT_PLAIN, EXTRA_NOT_PLAIN]
            (captured,) = r["captured"]  # layer 1's updated residual, on this rank's rows
            torch.testing.assert_close(captured, mine(r, ref["captured"][0]), atol=1e-5,
                                       rtol=0)


@pytest.mark.timeout(120)
def test_the_update_never_moves_before_a_sum_and_no_candidate_stands_in():
    """tp 4 dp 2 ar: a plain FFN input would add the residual on one attention-TP rank and
    let one TP all-reduce sum and gather (scaling the residual too); the scaled update
    completes the attention's sum over attention TP first, then scales and adds. The reference
    provider's fused add+norm is offered at every input and never accepted for it."""
    counts = (5, 3)
    ref = run(1, 1, "ar", counts)
    for r in get_pool(4).run(run, 4, 2, "ar", counts, False, True):
        torch.testing.assert_close(r["out"], mine(r, ref["out"]), atol=1e-5, rtol=0)
        assert r["offered"] > 0 and r["accepted"] == 0
        ffn_sums = [s for s in r["sums"] if s[2].endswith(".ffn.prepare")]
        assert ffn_sums == [("all_reduce", "attn_tp", f"layer{i}.ffn.prepare")
                            for i in range(LAYERS)]
        assert r["ffn_entry"].startswith("all_reduce(attn_tp) -> update+norm"), r["ffn_entry"]


def test_a_candidate_declines_it_before_touching_anything():
    residual, value = seeded((3, HIDDEN), 1), seeded((3, HIDDEN), 2)
    arrival = Arrival(value=value, owed=None, rows=None, update=ScaledAdd(M_FFN),
                      residual=residual, residual_rows=None, norm=toy_norm(5), facts=None)
    out = finalize_all_reduce_add_norm(arrival)
    assert isinstance(out, Declined)
    assert out.reason == "the update (ScaledAdd) is not a plain add"


def pipeline(tp: int, dp: int, policy: str, counts) -> dict:
    """A 2-stage pipeline cut after layer 1's PARTIAL attention: its declared sum crosses
    unreduced with the scaled update pending, which the receiver's own copy of the update (a
    constant of the declaration) applies after completing the sum."""
    dims = ParallelDims(world_size=2 * tp, tp=tp, pp=2, attn_dp=dp)
    rt = BoundaryRuntime(build_parallel(dims), boundary_reduction=policy)
    par = rt.parallel
    layers, final = stack(rt)
    b = DpBatch(counts, rt)
    fb = b.fb
    residual_batch.start(fb)
    if par.first_stage:
        h = layers[0].forward_layer(b.mine(seeded((sum(counts), HIDDEN), 8)), fb)
        sent = residual_batch.to_pp(layers[1].attn_half(h, fb), fb)
        send_to_next_stage(sent, par.pp_group)
        return {"sent": sorted(sent)}
    h = layers[1].ffn_half(layers[1].ffn.from_pp(recv_from_prev_stage(par.pp_group), fb), fb)
    h = layers[2].forward_layer(h, fb)
    return {"out": residual_batch.norm(h, fb, final), "rows": (b.rows.start, b.rows.stop)}


@pytest.mark.timeout(120)
def test_a_declared_sum_crosses_a_pipeline_cut_with_the_update_pending():
    counts = (5,)
    ref = run(1, 1, "ar", counts)
    results = get_pool(4).run(pipeline, 2, 1, "rs", counts)
    assert all(r["sent"] == ["partial", "residual"] for r in results[:2])
    for r in results[2:]:
        torch.testing.assert_close(r["out"], mine(r, ref["out"]), atol=1e-5, rtol=0)


def test_what_it_declares():
    update = ScaledAdd(0.22)
    assert repr(update) == "ScaledAdd(0.22)"
    assert not is_plain(update) and is_portable(update) and not update.at_producer
    assert scaled_update(1) is None and repr(scaled_update(2)) == "ScaledAdd(2.0)"
    c = seeded((2, HIDDEN), 3)
    assert torch.equal(update.apply(None, c), c * 0.22)  # no residual yet: the scaled output


@pytest.mark.parametrize("value,error,said", [
    (float("nan"), ValueError, "nan"), (float("inf"), ValueError, "inf"),
    (0, ValueError, "0"), (-0.5, ValueError, "-0.5"),
    ("2", TypeError, "'2'"), (True, TypeError, "True"), (None, TypeError, "None"),
])
def test_a_multiplier_the_config_check_refuses_is_refused_by_name(value, error, said):
    """What config.json's residual_multiplier may not be (a positive, finite number), the
    library's entry points may not take either: NaN made every output NaN, a bool or a
    string was read as a number."""
    for who, make in (("ScaledAdd", ScaledAdd), ("scaled_update", scaled_update)):
        with pytest.raises(error, match=rf"^{who}\(multiplier={re.escape(said)}\): "
                                        "multiplier must be a"):
            make(value)


def test_bf16_scales_and_adds_in_fp32_and_rounds_once():
    norm = toy_norm(5).bfloat16()
    residual, out = seeded((4, HIDDEN), 1).bfloat16(), seeded((4, HIDDEN), 2).bfloat16()
    total = residual.float() + out.float() * M_FFN
    assert torch.equal(ScaledAdd(M_FFN).apply(residual, out), total.bfloat16())
    x, kept = ADD_NORM_READ.update_and_read(ScaledAdd(M_FFN), residual, out, norm)
    assert kept.dtype is torch.bfloat16 and torch.equal(kept, total.bfloat16())
    # the norm reads the fp32 sum, not the rounded residual
    assert torch.equal(x, norm.normalize_fp32(total, torch.bfloat16))


def test_a_subclass_inherits_neither_capabilities_nor_the_fused_read():
    class Clamped(ScaledAdd):
        def apply(self, residual, contribution):
            return super().apply(residual, contribution).clamp(-1, 1)

    update, norm = Clamped(M_ATTN), toy_norm(5)
    residual, out = seeded((4, HIDDEN), 1) * 3, seeded((4, HIDDEN), 2)
    assert not is_portable(update)
    x, kept = ADD_NORM_READ.update_and_read(update, residual, out, norm)
    assert torch.equal(kept, update.apply(residual, out)) and kept.abs().max() <= 1
    assert torch.equal(x, norm(kept))
