"""Pipeline transport (to_pp / from_pp) on the toy stack, on every row mode.

Two pipeline stages over gloo point to point: the first runs the stack's first layers and
sends, the second receives and runs the rest and the final norm. Split after a whole layer
(the FFN's per-batch work completes before transport) and inside a layer, after a PARTIAL
attention (its declared sum crosses unreduced and the receiver completes it once). Each
receiver's output equals world 1 on its rows; the ledger shows one send per handoff with the
residual's rows on this rank, and nothing summed twice.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from toy import HIDDEN, AddAtProducer, DpBatch, ToyLayer, seeded, toy_norm

from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual.add_norm import PlainAdd
from layer_boundary.residual.batch import COMPLETED_BEFORE_PP
from layer_boundary.runtime import (LEDGER, BoundaryRuntime, ParallelDims, build_parallel,
                                    recv_from_prev_stage, send_to_next_stage)

from .pool import get_pool

LAYERS = 3
SUMS = ("all_reduce", "reduce_scatter")


def _stack(rt, at_producer: bool = False):
    update = AddAtProducer() if at_producer else None
    return [ToyLayer(rt, i, LAYERS, ffn_update=update) for i in range(LAYERS)], toy_norm(300)


def world1(counts) -> torch.Tensor:
    rt = BoundaryRuntime(build_parallel(ParallelDims()))
    layers, final = _stack(rt)
    b = DpBatch(counts, rt)
    residual_batch.start(b.fb)
    h = seeded((sum(counts), HIDDEN), 8)
    for layer in layers:
        h = layer.forward_layer(h, b.fb)
    return residual_batch.norm(h, b.fb, final)


def run(tp: int, dp: int, policy: str, counts, cut: tuple[int, str], misuse: bool = False,
        before: str = ""):
    """This rank's stage of a 2-stage pipeline cut before layer ``cut[0]`` ("layer") or after
    its attention ("attn"). ``before``: what the sender does to its last output first:
    "fold", "written" (fold, then write the residual back), or "at_producer" (FFNs whose
    update is applied at their exit)."""
    dims = ParallelDims(world_size=2 * tp, tp=tp, pp=2, attn_dp=dp)
    rt = BoundaryRuntime(build_parallel(dims), boundary_reduction=policy)
    par = rt.parallel
    layers, final = _stack(rt, at_producer=before == "at_producer")
    b = DpBatch(counts, rt)
    fb = b.fb
    k, where = cut
    residual_batch.start(fb)
    out = error = None
    if misuse and not par.first_stage:
        return {"error": None, "released": True}  # nothing is sent: the sender refuses
    with LEDGER.recording() as ledger:
        if par.first_stage:
            h = b.mine(seeded((sum(counts), HIDDEN), 8))
            for layer in layers[:k]:
                h = layer.forward_layer(h, fb)
            if where == "attn":
                h = layers[k].attn_half(h, fb)
            if misuse:
                h = residual_batch.complete_output(h, fb)
                try:
                    residual_batch.to_pp(h, fb)
                except RuntimeError as e:
                    error = str(e)
                return {"error": error, "released": fb.residual_stream is None}
            if before in ("fold", "written"):
                h = residual_batch.fold(h, fb)
                if before == "written":
                    h = residual_batch.written(h.clone(), fb)
            LEDGER.enter("pp_send")
            send_to_next_stage(residual_batch.to_pp(h, fb), par.pp_group)
        else:
            LEDGER.enter("pp_recv")
            tensors = recv_from_prev_stage(par.pp_group)
            if where == "attn":
                h = layers[k].ffn_half(layers[k].ffn.from_pp(tensors, fb), fb)
                rest = layers[k + 1:]
            else:
                h = layers[k].forward_layer(layers[k].attn.from_pp(tensors, fb), fb)
                rest = layers[k + 1:]
            for layer in rest:
                h = layer.forward_layer(h, fb)
            out = residual_batch.norm(h, fb, final)
    rows = fb.rows
    residual_rows = rows.count(rows.layouts.residual(rows.mode))
    return {"out": out, "rows": (b.rows.start, b.rows.stop), "first": par.first_stage,
            "mode": rows.mode.value, "released": fb.residual_stream is None,
            "p2p": [(e.kind, e.group, e.numel, e.site) for e in ledger
                    if e.kind in ("send", "recv")],
            "sums": [(e.kind, e.group, e.site) for e in ledger if e.kind in SUMS],
            "residual_rows": residual_rows, "local": rows.local, "attn_tp": par.attn_tp_group.size}


CASES = [(1, 1, "ar", (5,)), (2, 1, "ar", (5,)), (2, 1, "rs", (5,)), (2, 2, "rsv", (3, 0)),
         (4, 2, "rs", (5, 3)), (4, 2, "rsv", (2, 5))]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["layer", "attn"])
@pytest.mark.parametrize("tp,dp,policy,counts", CASES,
                         ids=[f"pp2-tp{t}-dp{d}-{p}" for t, d, p, _ in CASES])
def test_pipeline_matches_world1(tp, dp, policy, counts, where):
    ref = world1(counts)
    cut = (1, where)
    for r in get_pool(2 * tp).run(run, tp, dp, policy, counts, cut):
        assert r["released"] and r["mode"] == policy
        width = r["residual_rows"] * HIDDEN
        # a declared sum (attention TP > 1) crosses unreduced, on the attention's rows
        partial = [r["local"] * HIDDEN] if where == "attn" and r["attn_tp"] > 1 else []
        numels = [n for n in [width] + partial if n]  # empty tensors send no payload
        kind = "send" if r["first"] else "recv"
        assert [(k, g, n) for k, g, n, _ in r["p2p"]] == [(kind, "pp", n) for n in numels]
        if r["first"]:
            # the cut attention's sum never runs on the sender
            assert not [s for s in r["sums"] if s[2] == "layer1.ffn.prepare"]
            continue
        torch.testing.assert_close(r["out"], ref[slice(*r["rows"])], atol=1e-5, rtol=0)
        if where == "attn" and r["attn_tp"] > 1:
            # the declared sum, completed once, by the receiver's input
            assert len([s for s in r["sums"] if s[2] == "layer1.ffn.prepare"]) == 1


@pytest.mark.timeout(120)
def test_complete_output_before_to_pp_is_refused():
    results = get_pool(4).run(run, 2, 1, "ar", (5,), (1, "attn"), True)
    for r in results[:2]:  # the first stage's ranks
        assert r["error"] == COMPLETED_BEFORE_PP


def _from_pp_misuse():
    dims = ParallelDims(world_size=4, tp=2, pp=2)
    rt = BoundaryRuntime(build_parallel(dims))
    layers, _ = _stack(rt)
    b = DpBatch((3,), rt)
    residual_batch.start(b.fb)
    errors = []
    for tensors in ({}, {"residual": torch.zeros(2, HIDDEN)},
                    {"residual": torch.zeros(3, HIDDEN), "partial": torch.zeros(3, HIDDEN)}):
        try:
            layers[1].attn.from_pp(tensors, b.fb)
        except RuntimeError as e:
            errors.append(str(e))
    try:
        layers[0].attn.from_pp({"residual": torch.zeros(3, HIDDEN)}, b.fb)
    except RuntimeError as e:
        errors.append(str(e))
    dist.barrier()
    return errors


@pytest.mark.timeout(120)
def test_from_pp_checks_what_arrives():
    errors = get_pool(4).run(_from_pp_misuse)[0]
    assert errors == [
        "stage layer1.attn expects ['residual'] from the previous pipeline stage, got []",
        "stage layer1.attn: the residual from the previous pipeline stage has 2 rows; this "
        "rank holds 3 on replicated in this batch",
        "stage layer1.attn expects ['residual'] from the previous pipeline stage, got "
        "['partial', 'residual']",
        "stage layer0.attn enters the stack (previous=None): it takes the stack's input "
        "through prepare(), not from_pp()"]


BEFORE_CASES = [(2, 1, "ar", (5,)), (2, 1, "rs", (5,)), (4, 2, "rs", (5, 3)),
                (4, 2, "rsv", (2, 5)), (2, 2, "rsv", (3, 0))]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("before", ["fold", "written", "at_producer"])
@pytest.mark.parametrize("tp,dp,policy,counts", BEFORE_CASES,
                         ids=[f"pp2-tp{t}-dp{d}-{p}" for t, d, p, _ in BEFORE_CASES])
def test_a_residual_written_on_local_rows_crosses_on_the_receivers_rows(tp, dp, policy, counts,
                                                                        before):
    """fold(), written() and an at_producer FFN leave the residual on local rows; under
    rs/rsv the receiver's declaration expects it scattered over attention TP, and to_pp()
    sends it there (each token row crosses once)."""
    ref = world1(counts)
    for r in get_pool(2 * tp).run(run, tp, dp, policy, counts, (1, "layer"), False, before):
        assert r["released"] and r["mode"] == policy
        kind = "send" if r["first"] else "recv"
        width = r["residual_rows"] * HIDDEN
        assert [(k, g, n) for k, g, n, _ in r["p2p"]] == ([(kind, "pp", width)] if width else [])
        if not r["first"]:
            torch.testing.assert_close(r["out"], ref[slice(*r["rows"])], atol=1e-5, rtol=0)


class KeepsBatchState(PlainAdd):
    """A plain add scaled by state kept per batch on the object: a receiver's copy of it
    would not hold the sender's state. Declares itself plain, not portable."""

    plain = True

    def __init__(self) -> None:
        self.scale = 1.0


def _stateful_cut(tp: int, policy: str):
    """A PARTIAL attention whose update is not portable, cut right after it: the sender
    refuses to_pp() (its declared sum would cross with the update pending), and the receiver's
    from_pp() refuses what would arrive."""
    dims = ParallelDims(world_size=2 * tp, tp=tp, pp=2)
    rt = BoundaryRuntime(build_parallel(dims), boundary_reduction=policy)
    update = KeepsBatchState()  # one object: neighbours compare their updates
    layers = [ToyLayer(rt, i, 2, attn_update=update) for i in range(2)]
    b = DpBatch((5,), rt)
    fb = b.fb
    residual_batch.start(fb)
    try:
        if rt.parallel.first_stage:
            h = layers[1].attn_half(layers[0].forward_layer(seeded((5, HIDDEN), 8), fb), fb)
            residual_batch.to_pp(h, fb)
        else:  # refused before the tensors are looked at
            layers[1].ffn.from_pp({"residual": torch.zeros(5, HIDDEN),
                                   "partial": torch.zeros(5, HIDDEN)}, fb)
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["ar", "rs"])
def test_an_update_that_is_not_portable_does_not_cross_a_cut(policy):
    from layer_boundary.residual.batch import NOT_PORTABLE

    errors = get_pool(4).run(_stateful_cut, 2, policy)
    for e in errors[:2]:  # the sender's ranks
        assert e is not None and e.startswith(NOT_PORTABLE.split("{")[0])
        assert "KeepsBatchState" in e
    for e in errors[2:]:
        assert e is not None and e.startswith("stage layer1.ffn: its producer's residual "
                                              "update") and "portable" in e


def _unplaced(tp: int):
    """A stream written before any boundary ran: norm() and add_to_output() work on local
    rows, to_pp() refuses (it cannot know the rows the receiver expects)."""
    from layer_boundary.residual.batch import UNPLACED_AT_PP

    rt = BoundaryRuntime(build_parallel(ParallelDims(world_size=tp, tp=tp)))
    norm = toy_norm(300)
    x, extra = seeded((4, HIDDEN), 1), seeded((4, HIDDEN), 2)
    out = {}
    b = DpBatch((4,), rt)
    residual_batch.start(b.fb)
    out["norm"] = residual_batch.norm(residual_batch.written(x, b.fb), b.fb, norm)
    b = DpBatch((4,), rt)
    residual_batch.start(b.fb)
    h = residual_batch.add_to_output(residual_batch.written(x, b.fb), b.fb, extra)
    out["add"] = residual_batch.norm(h, b.fb, norm)
    b = DpBatch((4,), rt)
    residual_batch.start(b.fb)
    h = residual_batch.add_to_output(residual_batch.written(x, b.fb), b.fb, extra)
    layer = ToyLayer(rt, 1, 2)  # a stage after the extra: it completes it as a plain add
    out["stage"] = residual_batch.norm(layer.forward_layer(h, b.fb), b.fb, norm)
    b = DpBatch((4,), rt)
    residual_batch.start(b.fb)
    try:
        residual_batch.to_pp(residual_batch.written(x, b.fb), b.fb)
    except RuntimeError as e:
        out["to_pp"] = str(e) == UNPLACED_AT_PP
    return out


@pytest.mark.timeout(60)
def test_a_stream_written_before_any_boundary():
    ref = _unplaced(1)
    norm, x, extra = toy_norm(300), seeded((4, HIDDEN), 1), seeded((4, HIDDEN), 2)
    torch.testing.assert_close(ref["norm"], norm(x))
    torch.testing.assert_close(ref["add"], norm(x + extra))
    assert ref["to_pp"] is True
    for r in get_pool(2).run(_unplaced, 2):
        for key in ("norm", "add", "stage"):
            torch.testing.assert_close(r[key], ref[key], atol=1e-5, rtol=0)
        assert r["to_pp"] is True
