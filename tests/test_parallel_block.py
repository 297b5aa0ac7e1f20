"""Parallel blocks (``parallel_block.py``): attention and FFN read one residual, one sum.

A toy stack of parallel layers, ``h = h + attn(n1(h)) + ffn(n2(h))`` with a PARTIAL attention
and a real row-parallel FFN declared ``declare_ffn(parallel=True)``, read through one shared
norm (Cohere) or two (GPT-NeoX). World 1 equals the layers written out in plain torch; every
multi-rank run (ar, rs, rsv, attention DP, a DP rank with no tokens, attention TP 1, a CP
batch, through the accessors) equals world 1; each layer runs one sum (the attention's partial
joins the FFN's, under attention DP on its own rows of the FFN's global ones); what cannot be
joined is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from torch import nn
from toy import HIDDEN, DpBatch, ToyAttn, ToyFfn, runtime, seeded, toy_norm

from layer_boundary import append_stages, declare_attn, declare_ffn, layer_stack
from layer_boundary.construction import UnsupportedBoundary
from layer_boundary.fusions.reference import ReferenceFusions
from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual.post_norm import PostNormAdd
from layer_boundary.runtime import LEDGER, BatchVariant, BoundaryRuntime, ParallelDims
from layer_boundary.runtime.parallel import virtual_parallel

LAYERS = 3
SUMS = ("all_reduce", "reduce_scatter")


class ParallelLayer(nn.Module):
    def __init__(self, rt, i: int, two_norms: bool, fusions=None):
        super().__init__()
        par = rt.parallel
        self.n1 = toy_norm(100 + i)
        self.n2 = toy_norm(200 + i) if two_norms else self.n1
        self.attn_c, self.ffn_c = ToyAttn(par, 300 + i), ToyFfn(par, 400 + i)
        opts = {} if fusions is None else {"fusions": fusions}
        self.attn, self.ffn = append_stages((declare_attn(), self.n1, opts),
                                            (declare_ffn(parallel=True), self.n2, opts),
                                            name=f"layer{i}")

    def forward(self, h, fb, run: bool = False):
        if run:  # the one-call form
            h = self.attn.run(h, fb, lambda x, fb: self.attn_c(x))
            return self.ffn.run(h, fb, lambda x, fb: self.ffn_c(x))
        h = self.attn.finish(self.attn_c(self.attn.prepare(h, fb)), fb)
        x = self.ffn.prepare(h, fb)
        with self.ffn.exit(fb) as out:
            y = self.ffn_c(x)
        return out.finish(y)


def build(rt, two_norms: bool, fusions=None):
    with layer_stack(rt):
        layers = [ParallelLayer(rt, i, two_norms, fusions) for i in range(LAYERS)]
    return layers, toy_norm(99)


def by_hand(two_norms: bool, x: torch.Tensor) -> torch.Tensor:
    """The world-1 stack in plain torch."""
    layers, final = build(runtime(), two_norms)
    h = x
    with torch.no_grad():
        for layer in layers:
            h = h + layer.attn_c(layer.n1(h)) + layer.ffn_c(layer.n2(h))
        return final(h)


def run(tp: int, dp: int, policy: str, counts, two_norms: bool = True, cp: int = 1,
        lens=None, accessors: bool = False, fusions: bool = False, one_call: bool = False):
    rt = runtime(tp, dp, cp, boundary_reduction=policy)
    provider = ReferenceFusions() if fusions else None
    layers, final = build(rt, two_norms, provider)
    b = DpBatch(counts, rt, lens)
    residual_batch.start(b.fb)
    h = b.mine(seeded((sum(counts), HIDDEN), 8))
    with LEDGER.recording() as ledger:
        for i, layer in enumerate(layers):
            h = layer(h, b.fb, one_call)
            if accessors and i == 0:  # a complete output on local rows: still one sum a layer
                h = residual_batch.complete_output(h, b.fb)
        out = residual_batch.norm(h, b.fb, final)
    mode = b.fb.rows.mode
    return {"out": out, "rows": (b.rows.start, b.rows.stop), "mode": mode.value,
            "variant": b.fb.variant.value, "released": b.fb.residual_stream is None,
            "sums": [(e.kind, e.group, e.site) for e in ledger if e.kind in SUMS],
            "plan": [s.describe(mode) for layer in layers for s in (layer.attn, layer.ffn)]}


def mine(r, full):
    return full[slice(*r["rows"])]


@pytest.mark.parametrize("two_norms", [False, True], ids=["one norm", "two norms"])
def test_world1_is_the_parallel_block_written_out(two_norms):
    x = seeded((6, HIDDEN), 8)
    for one_call in (False, True):
        r = run(1, 1, "ar", (6,), two_norms, one_call=one_call)
        torch.testing.assert_close(r["out"], by_hand(two_norms, x), atol=1e-6, rtol=0)
        assert r["released"] and r["sums"] == []


# (tp, dp, policy, counts): attention TP 2 and 1, an idle DP rank, every row mode
CASES = [(2, 1, "ar", (5,)), (2, 1, "rs", (5,)), (4, 2, "ar", (5, 3)), (4, 2, "rs", (5, 0)),
         (4, 2, "rsv", (3, 5)), (4, 4, "rsv", (2, 0, 3, 1)), (2, 2, "ar", (0, 4))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy,counts", CASES,
                         ids=[f"tp{t}-dp{d}-{p}" for t, d, p, _ in CASES])
def test_every_row_mode_matches_world1_with_one_sum_a_layer(tp, dp, policy, counts):
    two_norms = tp == 4
    accessors = policy == "rs"  # complete_output on a joined output, over the cases
    one_call = policy == "rsv"
    ref = run(1, 1, "ar", counts, two_norms)
    for rank, r in enumerate(get_pool(tp).run(run, tp, dp, policy, counts, two_norms,
                                              accessors=accessors, one_call=one_call)):
        assert r["mode"] == policy and r["released"]
        torch.testing.assert_close(r["out"], mine(r, ref["out"]), atol=1e-5, rtol=0,
                                   msg=lambda m: f"rank {rank}: {m}")
        kind = "all_reduce" if policy == "ar" else "reduce_scatter"
        # one TP sum after each layer: the next attention's prepare, then the final norm
        sites = [f"layer{i}.attn.prepare" for i in range(1, LAYERS)] + ["final_norm"]
        if accessors:  # the accessor completes layer 0's joined sum (an all-reduce onto local
            # rows, charged to the site it follows) instead of layer 1's entry
            assert r["sums"][0] == ("all_reduce", "tp", "layer0.ffn.finish"), r["sums"]
            sites[0], r["sums"][0] = "layer0.ffn.finish", (kind, "tp", "layer0.ffn.finish")
        assert r["sums"] == [(kind, "tp", site) for site in sites], r["sums"]


CP_CASES = [(2, 1, 2, "ar", ((3, 4),)), (4, 2, 2, "rs", ((5,), (2, 3)))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,cp,policy,lens", CP_CASES,
                         ids=[f"tp{t}-dp{d}-cp{c}-{p}" for t, d, c, p, _ in CP_CASES])
def test_a_cp_batch_joins_each_share_on_its_own_rows(tp, dp, cp, policy, lens):
    counts = tuple(sum(per) for per in lens)
    ref = run(1, 1, "ar", counts)
    for r in get_pool(tp).run(run, tp, dp, policy, counts, True, cp, lens):
        assert r["variant"] == "CP"
        torch.testing.assert_close(r["out"], mine(r, ref["out"]), atol=1e-5, rtol=0)


@pytest.mark.timeout(120)
def test_a_fusion_provider_completes_the_joined_sum():
    counts = (5, 3)
    ref = run(1, 1, "ar", counts)
    for r in get_pool(4).run(run, 4, 2, "ar", counts, True, fusions=True):
        torch.testing.assert_close(r["out"], mine(r, ref["out"]), atol=1e-5, rtol=0)
        ffn = r["plan"][1]
        assert ffn["entry"].startswith("the attention's partial set aside; norm of the same "
                                       "residual"), ffn
        assert "sum left to the next input" in ffn["exit"], ffn


def _stack(rt, attn, ffn):
    with layer_stack(rt):
        append_stages((attn, toy_norm(1)), (ffn, toy_norm(2)), name="layer0")


@pytest.mark.parametrize("attn,ffn,message", [
    (declare_ffn(), declare_ffn(parallel=True), "follows a PARTIAL attention, not ffn"),
    (declare_attn(update=PostNormAdd.elsewhere("post")), declare_ffn(parallel=True),
     "both updates must be plain adds; attention"),
])
def test_what_cannot_be_joined_is_refused_at_construction(attn, ffn, message):
    with pytest.raises(UnsupportedBoundary, match=message):
        _stack(runtime(), attn, ffn)


def test_a_sequence_parallel_runtime_is_refused_by_name():
    rt = BoundaryRuntime(virtual_parallel(ParallelDims(world_size=2, tp=2), 0),
                         boundary_reduction="rs",
                         batch_variants=(BatchVariant.ORDINARY, BatchVariant.SEQUENCE_PARALLEL))
    with torch.device("meta"):  # construction only
        with pytest.raises(UnsupportedBoundary, match="not offered in a sequence-parallel"):
            _stack(rt, declare_attn(), declare_ffn(parallel=True))


def test_a_parallel_ffn_refuses_postprocess_before_anything_changes():
    rt = runtime()
    layers, _ = build(rt, two_norms=False)
    b = DpBatch((4,), rt)
    residual_batch.start(b.fb)
    layer = layers[0]
    h = layer.attn.finish(layer.attn_c(layer.attn.prepare(seeded((4, HIDDEN), 1), b.fb)), b.fb)
    x = layer.ffn.prepare(h, b.fb)
    with pytest.raises(RuntimeError, match="parallel block's FFN: its sum also completes"):
        layer.ffn.postprocess(layer.ffn_c(x), b.fb)


@pytest.mark.parametrize("kwargs", [dict(sparse=True), dict(sequence_parallel=True)])
def test_a_parallel_ffn_is_a_dense_scoped_one(kwargs):
    with pytest.raises(ValueError, match="parallel=True is for a dense SCOPED FFN"):
        declare_ffn(parallel=True, **kwargs)
