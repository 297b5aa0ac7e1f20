"""mHC (residual/mhc.py) through the boundaries, on every row mode.

A toy stack whose residual is HC streams: a PARTIAL attention and a real row-parallel FFN per
layer, each with its own hyper-connection, and a hyper-head final norm. World 1 equals the
same stack run by transformers' DeepseekV4HyperConnection / HyperHead; every multi-rank run
(ar, rs, rsv, attention DP, an empty DP rank) equals world 1, through the plain path and
through the accessors; the update never moves before a sum; no fusion candidate is offered to
it; snapshot refuses it.
"""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from torch import nn
from toy import (HIDDEN, DpBatch, ToyAttn, ToyFfn, ToyStack, runtime, seeded, through_layers,
                 toy_norm)

from layer_boundary import declare_attn, declare_ffn, make_stages
from layer_boundary.fusions.reference import ReferenceFusions
from layer_boundary.layout import RowMode
from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual.batch import SNAPSHOT_NOT_PLAIN
from layer_boundary.residual.mhc import (MHC_UPDATE, NEEDS_COEFFICIENTS, HyperConnection,
                                         HyperHead, MhcFinalNorm, MhcRead, mhc_stage)
from layer_boundary.runtime import LEDGER

HC, ITERS, EPS = 3, 4, 1e-6
LAYERS = 2
SUMS = ("all_reduce", "reduce_scatter")


def hyper_connection(seed: int) -> HyperConnection:
    hc = HyperConnection(HIDDEN, HC, ITERS, EPS, EPS)
    with torch.no_grad():
        hc.fn.copy_(0.3 * seeded(hc.fn.shape, seed))
        hc.base.copy_(0.5 * seeded(hc.base.shape, seed + 1))
        hc.scale.copy_(1 + 0.2 * seeded(hc.scale.shape, seed + 2))
    return hc


def hyper_head(seed: int) -> HyperHead:
    head = HyperHead(HIDDEN, HC, EPS, EPS)
    with torch.no_grad():
        head.hc_fn.copy_(0.3 * seeded(head.hc_fn.shape, seed))
        head.hc_base.copy_(0.5 * seeded(head.hc_base.shape, seed + 1))
        head.hc_scale.copy_(1 + 0.2 * seeded(head.hc_scale.shape, seed + 2))
    return head


class ToyMhcLayer(nn.Module):
    def __init__(self, rt, i: int, layers: int, fusions=None):
        super().__init__()
        par = rt.parallel
        self.attn_hc, self.ffn_hc = hyper_connection(10 * i), hyper_connection(10 * i + 5)
        self.attn_norm, self.ffn_norm = toy_norm(100 + i), toy_norm(200 + i)
        self.attn_c, self.ffn_c = ToyAttn(par, 300 + i), ToyFfn(par, 400 + i)
        opts = {} if fusions is None else {"fusions": fusions}
        self.attn, self.ffn = make_stages(
            (declare_attn(**mhc_stage(self.attn_hc)), self.attn_norm, opts),
            (declare_ffn(**mhc_stage(self.ffn_hc)), self.ffn_norm, opts),
            # the previous layer's FFN: what matters to this layer is its (nonlinear) update
            previous=None if i == 0 else declare_ffn(**mhc_stage(self.ffn_hc)),
            terminal=i == layers - 1, runtime=rt, name=f"layer{i}")

    def forward(self, h, fb, **capture):
        h = self.attn.finish(self.attn_c(self.attn.prepare(h, fb, **capture)), fb)
        h = self.ffn.prepare(h, fb)
        with self.ffn.exit(fb) as out:
            y = self.ffn_c(h)
        return out.finish(y)


def stack(rt, fusions=None):
    layers = [ToyMhcLayer(rt, i, LAYERS, fusions) for i in range(LAYERS)]
    return layers, MhcFinalNorm(hyper_head(77), toy_norm(99))


def by_transformers(layers, final, x):
    """The world-1 stack as DeepSeek-V4's decoder layer runs it, with transformers' modules."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4HyperConnection,
                                                                      DeepseekV4HyperHead)

    cfg = DeepseekV4Config(hidden_size=HIDDEN, hc_mult=HC, hc_sinkhorn_iters=ITERS, hc_eps=EPS,
                           rms_norm_eps=EPS)

    def theirs(cls, ours):
        module = cls(cfg)
        module.load_state_dict(ours.state_dict())
        return module

    streams = x.unsqueeze(1).expand(-1, HC, -1)[None].contiguous()  # [1, T, N, D]
    with torch.no_grad():
        for layer in layers:
            for hc, norm, compute in ((layer.attn_hc, layer.attn_norm, layer.attn_c),
                                      (layer.ffn_hc, layer.ffn_norm, layer.ffn_c)):
                post, comb, collapsed = theirs(DeepseekV4HyperConnection, hc)(streams)
                out = compute(norm(collapsed[0]))[None]
                streams = (post.unsqueeze(-1) * out.unsqueeze(-2)
                           + torch.matmul(comb.transpose(-1, -2), streams)).contiguous()
        return final.norm(theirs(DeepseekV4HyperHead, final.head)(streams))[0]


def run(tp: int, dp: int, policy: str, counts, accessors: bool = False,
        fusions: bool = False) -> dict:
    rt = runtime(tp, dp, boundary_reduction=policy)
    provider = ReferenceFusions() if fusions else None
    layers, final = stack(rt, provider)
    b = DpBatch(counts, rt)
    residual_batch.start(b.fb)
    h = b.mine(seeded((sum(counts), HIDDEN), 8))
    with LEDGER.recording() as ledger:
        h, captured, refused = through_layers(layers, h, b.fb, accessors)
        if accessors:
            streams = residual_batch.take_output(residual_batch.fold(h, b.fb), b.fb)
            out = final(streams)
        else:
            out = residual_batch.norm(h, b.fb, final)
    mode = b.fb.rows.mode
    return {"out": out, "rows": (b.rows.start, b.rows.stop), "mode": mode.value,
            "released": b.fb.residual_stream is None, "refused": refused, "captured": captured,
            "sums": [(e.kind, e.group, e.site) for e in ledger if e.kind in SUMS],
            "offered": sum(len(p.candidates) for layer in layers for s in (layer.attn, layer.ffn)
                           for p in s.plan.paths[next(iter(s.plan.paths))].entry.arrivals.values()),
            "accepted": provider.accepted if provider else 0,
            "ffn_entry": layers[-1].ffn.describe(mode)["entry"]}


def test_world1_matches_transformers_hyper_connections():
    counts = (6,)
    r = run(1, 1, "ar", counts)
    rt = runtime()
    layers, final = stack(rt)
    expected = by_transformers(layers, final, seeded((6, HIDDEN), 8))
    torch.testing.assert_close(r["out"], expected, atol=1e-5, rtol=0)
    assert r["released"]


CASES = [(2, 1, "ar", (5,)), (2, 1, "rs", (5,)), (4, 2, "ar", (5, 3)), (4, 2, "rs", (5, 0)),
         (4, 2, "rsv", (3, 5)), (4, 4, "rsv", (2, 0, 3, 1)), (4, 4, "ar", (2, 0, 3, 1))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("accessors", [False, True], ids=["norm", "accessors"])
@pytest.mark.parametrize("tp,dp,policy,counts", CASES,
                         ids=[f"tp{t}-dp{d}-{p}" for t, d, p, _ in CASES])
def test_every_row_mode_matches_world1(tp, dp, policy, counts, accessors):
    ref = run(1, 1, "ar", counts)
    for rank, r in enumerate(get_pool(tp).run(run, tp, dp, policy, counts, accessors)):
        assert r["mode"] == policy and r["released"]
        torch.testing.assert_close(r["out"], ref["out"][slice(*r["rows"])], atol=1e-5, rtol=0,
                                   msg=lambda m: f"rank {rank}: {m}")
        if accessors:
            assert r["refused"] == SNAPSHOT_NOT_PLAIN
            (streams,) = r["captured"]
            assert streams.shape == (r["rows"][1] - r["rows"][0], HC, HIDDEN)
            torch.testing.assert_close(streams, world1_capture(counts)[slice(*r["rows"])],
                                       atol=1e-5, rtol=0)


def world1_capture(counts) -> torch.Tensor:
    return run(1, 1, "ar", counts, True)["captured"][0]


@pytest.mark.timeout(120)
def test_the_update_never_moves_before_a_sum():
    """tp=4 dp=2 ar: a plain FFN input adds the residual on one attention-TP rank and lets one
    TP all-reduce sum and gather (the shortcut); an mHC input completes the attention's sum
    over attention TP first, then updates, then gathers. Both match world 1."""
    counts = (5, 3)
    ref = run(1, 1, "ar", counts)
    for r in get_pool(4).run(run, 4, 2, "ar", counts):
        torch.testing.assert_close(r["out"], ref["out"][slice(*r["rows"])], atol=1e-5, rtol=0)
        ffn_sums = [s for s in r["sums"] if s[2].endswith(".ffn.prepare")]
        assert ffn_sums == [("all_reduce", "attn_tp", f"layer{i}.ffn.prepare")
                            for i in range(LAYERS)]
        assert "add on attn_tp rank 0" not in r["ffn_entry"]
        assert r["ffn_entry"].startswith("all_reduce(attn_tp) -> update+read")
    # the same topology with a plain update takes the shortcut: the check above can fail
    assert all(e.startswith("add on attn_tp rank 0") for e in get_pool(4).run(_plain_ffn_entry))


def _plain_ffn_entry() -> str:
    return ToyStack(runtime(4, 2), layers=2).layers[1].ffn.describe(RowMode.AR)["entry"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy,counts", [(1, 1, "ar", (5,)), (4, 2, "ar", (5, 3)),
                                                 (4, 4, "rsv", (2, 0, 3, 1))])
def test_no_fusion_candidate_is_offered(tp, dp, policy, counts):
    """The reference provider offers its fused add+norm to every input; none applies to an
    mHC arrival (a nonlinear update, a custom read), so nothing is accepted and the numbers
    are the unfused ones."""
    ref = run(1, 1, "ar", counts)
    for r in get_pool(tp).run(run, tp, dp, policy, counts, False, True):
        assert r["offered"] == 0 and r["accepted"] == 0
        torch.testing.assert_close(r["out"], ref["out"][slice(*r["rows"])], atol=1e-5, rtol=0)


def test_update_needs_its_reads_coefficients():
    read = MhcRead(hyper_connection(0))
    x = seeded((4, HIDDEN), 1)
    _, held = read.enter(x, toy_norm(0))
    assert held.shape == (4, HC, HIDDEN + 1 + HC)
    streams = MHC_UPDATE.apply(held, x)
    assert streams.shape == (4, HC, HIDDEN)
    with pytest.raises(RuntimeError, match="^" + NEEDS_COEFFICIENTS.replace("(", r"\(")
                       .replace(")", r"\)").replace("?", r"\?") + "$"):
        MHC_UPDATE.apply(streams, x)
    assert not MHC_UPDATE.plain and read.kind is None


def extras(tp: int, dp: int, policy: str, counts) -> dict:
    """An extra offered to an mHC residual at layer 1, written (fold, written) or pending,
    through prepare(post_residual_addition=) and add_to_output(): each refused before it
    touches anything, after which the forward goes on unchanged."""
    rt = runtime(tp, dp, boundary_reduction=policy)
    layers, final = stack(rt)
    refusals, outs = {}, {}
    for how in ("pending", "fold", "written"):
        for call in ("prepare", "add_to_output"):
            b = DpBatch(counts, rt)
            fb = b.fb
            residual_batch.start(fb)
            h = layers[0].forward(b.mine(seeded((sum(counts), HIDDEN), 8)), fb)
            if how != "pending":
                h = residual_batch.fold(h, fb)
                if how == "written":
                    h = residual_batch.written(h, fb)
            extra = b.mine(seeded((sum(counts), HIDDEN), 9))
            try:
                if call == "prepare":
                    layers[1].attn.prepare(h, fb, post_residual_addition=extra)
                else:
                    residual_batch.add_to_output(h, fb, extra)
            except RuntimeError as e:
                refusals[how, call] = str(e)
            outs[how, call] = residual_batch.norm(layers[1].forward(h, fb), fb, final)
    return {"refusals": refusals, "outs": outs, "rows": (b.rows.start, b.rows.stop),
            "mode": fb.rows.mode.value}


EXTRA_CASES = [(1, 1, "ar", (3,)), (2, 1, "ar", (3,)), (2, 1, "rs", (3,)), (4, 2, "ar", (3, 3)),
               (4, 2, "rs", (0, 3)), (4, 2, "rsv", (3, 0))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy,counts", EXTRA_CASES,
                         ids=[f"tp{t}-dp{d}-{p}" for t, d, p, _ in EXTRA_CASES])
def test_an_extra_is_refused_on_an_mhc_residual_written_or_pending(tp, dp, policy, counts):
    """T equal to hc_mult: a [T, D] extra broadcast over [T, N, D] streams would raise
    nothing. The refusal is the same whether or not an output is pending."""
    from layer_boundary.residual.batch import EXTRA_NOT_PLAIN
    from layer_boundary.capture import NOT_PLAIN_ADDITION

    ref = run(1, 1, "ar", counts)["out"]
    results = get_pool(tp).run(extras, tp, dp, policy, counts) if tp > 1 else [
        extras(1, 1, policy, counts)]
    for r in results:
        assert r["mode"] == policy
        assert r["refusals"] == {
            (how, call): NOT_PLAIN_ADDITION if call == "prepare" else EXTRA_NOT_PLAIN
            for how in ("pending", "fold", "written") for call in ("prepare", "add_to_output")}
        for key, out in r["outs"].items():
            torch.testing.assert_close(out, ref[slice(*r["rows"])], atol=1e-5, rtol=0,
                                       msg=lambda m: f"{key}: {m}")
