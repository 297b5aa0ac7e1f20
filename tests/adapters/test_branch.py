"""Prepared branches (branch_input, branch_output, merge_branch) on every row mode.

A toy LongCat layer: attention 0, a source FFN whose prepared input also feeds a branch of a
dense FFN, attention 1 and another dense FFN; the layer's output is the branch's plus the
source's. World 1 equals that formula written by hand; every multi-rank run equals world 1;
every sum of a layer runs exactly once, where the plan says; misuse raises.
"""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from torch import nn
from toy import HIDDEN, DpBatch, ToyAttn, ToyFfn, batch, runtime, seeded, toy_norm

from layer_boundary import (branch_input, branch_output, declare_attn, declare_ffn, layer_stack,
                            make_stages, merge_branch)
from layer_boundary.construction import UnsupportedBoundary
from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual.stream import NOT_OURS
from layer_boundary.runtime import LEDGER, BatchVariant
from layer_boundary.stage import BRANCH_ENTRY

LAYERS = 2


class ToyLongCatLayer(nn.Module):
    def __init__(self, rt, i: int, layers: int):
        super().__init__()
        par, last = rt.parallel, i == layers - 1
        self.norms = [toy_norm(10 * i + k) for k in range(4)]
        self.attn_c = [ToyAttn(par, 100 + 10 * i + k) for k in range(2)]
        self.src_c = ToyFfn(par, 300 + i)
        self.ffn_c = [ToyFfn(par, 400 + 10 * i + k) for k in range(2)]
        src_decl = declare_ffn()
        following = None if last else declare_attn()
        self.attn0, self.src = make_stages(
            (declare_attn(), self.norms[0]), (src_decl, self.norms[1]),
            previous=None if i == 0 else declare_ffn(), following=following, terminal=last,
            runtime=rt, name=f"layer{i}")
        self.ffn0, self.attn1, self.ffn1 = make_stages(
            (declare_ffn(), self.norms[1]), (declare_attn(), self.norms[2]),
            (declare_ffn(), self.norms[3]), prepared_from=self.src.declaration,
            following=following, terminal=last, runtime=rt, name=f"layer{i}.branch")

    def forward(self, h, fb):
        h = self.attn0.finish(self.attn_c[0](self.attn0.prepare(h, fb)), fb)
        h = self.src.prepare(h, fb)
        with self.src.exit(fb) as out:
            m = self.src_c(h)
        m = out.finish(m)
        x = branch_input(self.src, h, fb)
        with self.ffn0.exit(fb) as out:
            y = self.ffn_c[0](x)
        y = out.finish(y)
        y = self.attn1.finish(self.attn_c[1](self.attn1.prepare(y, fb)), fb)
        y = self.ffn1.prepare(y, fb)
        with self.ffn1.exit(fb) as out:
            z = self.ffn_c[1](y)
        y = branch_output(out.finish(z), fb)
        return merge_branch(m, y, fb)

    def by_hand(self, r):
        """The same layer at world 1 without boundaries (LongCat's order of operations)."""
        n = [lambda x, k=k: self.norms[k].normalize_fp32(x.float(), x.dtype) for k in range(4)]
        r = r + self.attn_c[0](n[0](r))
        h = n[1](r)
        m = self.src_c(h)
        r = r + self.ffn_c[0](h)
        r = r + self.attn_c[1](n[2](r))
        return r + self.ffn_c[1](n[3](r)) + m


def run(tp: int, dp: int, policy: str, counts) -> dict:
    rt = runtime(tp, dp, boundary_reduction=policy)
    with layer_stack(rt):
        layers = [ToyLongCatLayer(rt, i, LAYERS) for i in range(LAYERS)]
    final = toy_norm(99)
    b = DpBatch(counts, rt)
    residual_batch.start(b.fb)
    h = b.mine(seeded((sum(counts), HIDDEN), 8))
    with LEDGER.recording() as ledger:
        for layer in layers:
            h = layer.forward(h, b.fb)
        out = residual_batch.norm(h, b.fb, final)
    sums = [(e.kind, e.group, e.site) for e in ledger
            if e.kind in ("all_reduce", "reduce_scatter")]
    ref = None
    if tp == 1:
        r = seeded((sum(counts), HIDDEN), 8)
        for layer in layers:
            r = layer.by_hand(r)
        ref = final.normalize_fp32(r.float(), r.dtype)
    return {"out": out, "by_hand": ref, "rows": (b.rows.start, b.rows.stop), "sums": sums,
            "mode": b.fb.rows.mode.value, "released": b.fb.residual_stream is None}


def test_world1_is_the_layer_written_by_hand():
    r = run(1, 1, "ar", (5,))
    torch.testing.assert_close(r["out"], r["by_hand"], atol=1e-5, rtol=0)
    assert r["released"]


CASES = [(2, 1, "ar", (5,)), (2, 1, "rs", (5,)), (4, 2, "ar", (5, 3)), (4, 2, "rs", (5, 0)),
         (4, 2, "rsv", (3, 5)), (4, 4, "rsv", (2, 0, 3, 1))]


def expected_sums(tp: int, dp: int, mode: str) -> list[tuple[str, str, str]]:
    """Each sum of a layer once: attention 0's at the source's input, the source's at the next
    layer's attention (last: in compute under ``ar``; under ``rs``/``rsv`` the final norm's
    reduce-scatter, the branch's output added on one rank before it), FFN 0's at attention 1,
    attention 1's at FFN 1, FFN 1's in branch_output (last under ``ar``: in compute)."""
    attn_tp = tp // dp
    scatter = mode != "ar"
    out = []
    for i in range(LAYERS):
        last = i == LAYERS - 1
        if i > 0:
            out.append(("reduce_scatter" if scatter else "all_reduce", "tp",
                        f"layer{i}.attn.prepare"))
        if attn_tp > 1:
            out.append(("reduce_scatter" if scatter else "all_reduce",
                        "tp" if not scatter and dp > 1 else "attn_tp", f"layer{i}.ffn.prepare"))
        if last and not scatter:
            out.append(("all_reduce", "tp", f"layer{i}.ffn.compute"))
        out.append(("reduce_scatter" if scatter else "all_reduce", "tp",
                    f"layer{i}.branch.attn.prepare"))
        if attn_tp > 1:
            out.append(("reduce_scatter" if scatter else "all_reduce",
                        "tp" if not scatter and dp > 1 else "attn_tp",
                        f"layer{i}.branch.ffn1.prepare"))
        # onto local rows: all-reduce and slice, or where local rows are the scattered ones
        # (attention TP 1), the mode's reduce-scatter
        onto_local = "reduce_scatter" if scatter and attn_tp == 1 else "all_reduce"
        in_compute = last and not scatter
        out.append(("all_reduce" if in_compute else onto_local, "tp",
                    f"layer{i}.branch.ffn1." + ("compute" if in_compute else "branch_output")))
    if scatter:
        out.append(("reduce_scatter", "tp", "final_norm"))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy,counts", CASES,
                         ids=[f"tp{t}-dp{d}-{p}" for t, d, p, _ in CASES])
def test_branches_match_world1_and_sum_once(tp, dp, policy, counts):
    ref = run(1, 1, "ar", counts)
    for rank, r in enumerate(get_pool(tp).run(run, tp, dp, policy, counts)):
        assert r["mode"] == policy and r["released"]
        torch.testing.assert_close(r["out"], ref["out"][slice(*r["rows"])], atol=1e-5, rtol=0,
                                   msg=lambda m: f"rank {rank}: {m}")
        assert r["sums"] == expected_sums(tp, dp, policy), rank


# ------------------------------------------------------------------ misuse


def _layer_up_to_source(tokens=3):
    rt = runtime()
    with layer_stack(rt):
        layer = ToyLongCatLayer(rt, 0, 2)
    fb = batch(tokens)
    residual_batch.start(fb)
    x = layer.attn0.prepare(seeded((tokens, HIDDEN), 1), fb)
    h = layer.attn0.finish(layer.attn_c[0](x), fb)
    return layer, fb, layer.src.prepare(h, fb)


def test_branch_misuse_raises():
    layer, fb, h = _layer_up_to_source()
    with pytest.raises(RuntimeError, match=f"^{BRANCH_ENTRY}$"):
        layer.ffn0.prepare(h, fb)
    with pytest.raises(RuntimeError, match="stage layer0.ffn has not published its output"):
        branch_input(layer.src, h, fb)
    with layer.src.exit(fb) as out:
        m = layer.src_c(h)
    m = out.finish(m)
    with pytest.raises(RuntimeError, match="branch_input takes the input stage layer0.ffn "
                                           "prepared in this forward"):
        branch_input(layer.src, h + 0, fb)
    with pytest.raises(RuntimeError, match="branch_output\\(\\) outside a branch"):
        branch_output(m, fb)
    with pytest.raises(RuntimeError, match="merge_branch\\(\\) outside a branch"):
        merge_branch(m, m, fb)
    x = branch_input(layer.src, h, fb)
    with layer.ffn0.exit(fb) as out:
        y = layer.ffn_c[0](x)
    y = out.finish(y)
    with pytest.raises(RuntimeError, match="merge_branch\\(\\) takes the branch's output from "
                                           "branch_output\\(\\)"):
        merge_branch(m, y, fb)
    with pytest.raises(RuntimeError, match=f"^{NOT_OURS}$"):
        merge_branch(y, branch_output(y, fb), fb)  # the source's output is not ``y``


@pytest.mark.parametrize("variant", [BatchVariant.CP, BatchVariant.SEQUENCE_PARALLEL],
                         ids=lambda v: v.value)
def test_branch_takes_ordinary_rows_only(variant):
    if variant is BatchVariant.CP:  # a CP topology (construction only: no ranks run)
        from layer_boundary.runtime import BoundaryRuntime
        from layer_boundary.runtime.parallel import ParallelDims, virtual_parallel

        rt = BoundaryRuntime(virtual_parallel(ParallelDims(world_size=2, tp=2, attn_cp=2)),
                             batch_variants=(variant,))
    else:
        rt = runtime(batch_variants=(BatchVariant.ORDINARY, variant))
    # ordinary stages build the variant's paths; only the branch refuses
    make_stages((declare_attn(), toy_norm(0)), runtime=rt, name="layer0", terminal=True)
    source = declare_ffn()
    with pytest.raises(UnsupportedBoundary, match="branch transport supports ordinary token rows "
                                                  "only: stage branch.ffn cannot run the "
                                                  f"{variant.value} batch"):
        make_stages((declare_ffn(), toy_norm(0)), prepared_from=source, runtime=rt,
                    name="branch", terminal=True)


def test_branch_takes_input_scattered_rows():
    """An input-scattered batch moves ordinary token rows (only where an attention's latent
    runs differs), so a branch builds for it and plans the same rows as for ordinary batches."""
    rt = runtime(batch_variants=(BatchVariant.ORDINARY, BatchVariant.INPUT_SCATTERED))
    source = declare_ffn()
    stages = make_stages((declare_ffn(), toy_norm(0)), prepared_from=source, runtime=rt,
                         name="branch", terminal=True)
    plan = stages[0].plan
    assert set(plan.variants) == {BatchVariant.ORDINARY, BatchVariant.INPUT_SCATTERED}


def test_plan_shows_both_branches_and_the_merge():
    from layer_boundary.layout import RowMode
    from layer_boundary.engine.describe import plan_rows

    rt = runtime(1)
    with layer_stack(rt):
        model = nn.ModuleList(ToyLongCatLayer(rt, i, LAYERS) for i in range(LAYERS))
    rows = plan_rows(model, RowMode.AR)
    names = [r["stage"] for r in rows]
    assert names[:6] == ["layer0.attn", "layer0.ffn", "layer0.branch.ffn0",
                         "layer0.branch.attn", "layer0.branch.ffn1", "layer0.branch.ffn1.merge"]
    assert rows[2]["entry"].startswith("branch_input from the prepared ffn (SCOPED) input")
    assert "merge_branch: added to layer0.ffn's output" in rows[5]["entry"]
