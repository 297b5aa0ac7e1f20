"""Two-batch overlap on the toy stack: the split, an operation-scheduled run (A attention,
B attention, A FFN, B FFN, ...) whose FFNs run without exit() and hand on through
postprocess(), on every row mode against world 1, the misuse the spec names, and the gate
that decides where a forward splits."""

from __future__ import annotations

import re

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, DpBatch, ToyStack, runtime, seeded

from layer_boundary.adapters.tbo import (EXIT_ACROSS_YIELD, ONE_RANK, ONE_SIDED, SHARED_CORES,
                                         SPLITS, TboDecision, TboPolicy, interleave,
                                         split_batch, split_counts, split_point, tbo_decision)
from layer_boundary.fusions.reference import ReferenceFusions
from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual.stream import NOT_OURS, SHARED_STREAM, ResidualStream
from layer_boundary.runtime import LEDGER, ForwardBatch, ForwardMode

LAYERS = 2


def test_split_balances_tokens_by_requests():
    assert split_point((5,)) == 1  # one request: the first microbatch takes it
    assert split_point((3, 3)) == 1 and split_point((4, 1, 1, 1)) == 1
    assert split_point((1, 1, 4)) == 2 and split_point(()) == 0
    assert split_counts(((5, 3), (7,), ())) == ((5, 7, 0), (3, 0, 0))
    fb = ForwardBatch.build(ForwardMode.EXTEND, [[1, 2], [3], [4, 5, 6]], [0, 0, 0],
                            dp_token_counts=(6, 1))
    fb.dp_request_lens = ((2, 1, 3), (1,))
    a, b = split_batch(fb, dp_rank=0)
    assert (a.input_ids.tolist(), b.input_ids.tolist()) == ([1, 2, 3], [4, 5, 6])
    assert (a.extend_lens, b.extend_lens) == ((2, 1), (3,))
    assert (a.dp_token_counts, b.dp_token_counts) == ((3, 1), (3, 0))
    assert a.kv_cache is fb.kv_cache and a.residual_stream is None
    fb.dp_request_lens = ((2, 1), (1,))
    with pytest.raises(ValueError, match=r"dp_request_lens\[0\] \(2, 1\) is not this rank's "
                                         r"requests \(2, 1, 3\)"):
        split_batch(fb, dp_rank=0)


def _microbatches(rt, counts):
    """This rank's two microbatches of a batch with one-token requests."""
    b = DpBatch(counts, rt)
    fb = b.fb
    n = fb.num_tokens
    fb = ForwardBatch.build(ForwardMode.EXTEND, [[t] for t in range(n)], [0] * n,
                            dp_token_counts=b.counts)
    fb.dp_request_lens = tuple((1,) * c for c in b.counts)
    return b, split_batch(fb, rt.parallel.attn_dp_rank if len(b.counts) > 1 else 0)


def run(tp: int, dp: int, policy: str, counts, postprocess: bool = True,
        sparse: bool = False, accessor: bool = False, fusions: bool = False) -> dict:
    """Two microbatches, operation-scheduled: per layer A attention, B attention, A FFN, B FFN
    (the FFNs computing without exit() and handing on through postprocess(), or with exit()
    and their owed sums issued asynchronously at finish); then each leaves through the final
    norm and the outputs merge in request order."""
    rt = runtime(tp, dp, boundary_reduction=policy)
    provider = ReferenceFusions() if fusions else None
    stack = ToyStack(rt, layers=LAYERS, ffn_sparse=sparse, fusions=provider)
    b, mbs = _microbatches(rt, counts)
    x = b.mine(seeded((sum(counts), HIDDEN), 8))
    n = mbs[0].num_tokens
    h = {0: x[:n], 1: x[n:]}
    for mb in mbs:
        ResidualStream.arrive(mb)

    def attn(layer, i):
        def op():
            h[i] = layer.attn_half(h[i], mbs[i])
        return op

    in_flight, handed_on = [], []

    def ffn(layer, i):
        def op():
            x = layer.ffn.prepare(h[i], mbs[i])
            if postprocess:
                h[i] = layer.ffn.postprocess(layer.ffn_compute(x), mbs[i])  # fully reduced
                handed_on.append(str(mbs[i].residual_stream.contribution.rows))
            else:
                with layer.ffn.exit(mbs[i]) as out:
                    y = layer.ffn_compute(x)
                h[i] = out.finish(y)
                # what the other microbatch's next operation overlaps
                in_flight.append(len(mbs[i].residual_stream.pending or ()))
                if accessor:  # the model takes the completed output itself
                    h[i] = residual_batch.complete_output(h[i], mbs[i])
        return op

    def leave(i):
        def op():
            h[i] = stack.final(h[i], mbs[i])
        return op

    with LEDGER.recording() as ledger:
        interleave([[f(layer, i) for layer in stack.layers for f in (attn, ffn)] + [leave(i)]
                    for i in (0, 1)])
    return {"out": torch.cat([h[0], h[1]]), "rows": (b.rows.start, b.rows.stop),
            "mode": mbs[0].rows.mode.value,
            "released": all(mb.residual_stream is None for mb in mbs),
            "sites": sorted({e.site for e in ledger}), "in_flight": in_flight,
            "handed_on": handed_on, "fused": provider.accepted if provider else 0}


def world1(counts) -> torch.Tensor:
    rt = runtime()
    stack = ToyStack(rt, layers=LAYERS)
    b = DpBatch(counts, rt)
    residual_batch.start(b.fb)
    h = seeded((sum(counts), HIDDEN), 8)
    for layer in stack.layers:
        h = layer.forward_layer(h, b.fb)
    return stack.final(h, b.fb)


CASES = [(1, 1, "ar", (5,)), (2, 1, "ar", (5,)), (2, 1, "rs", (5,)), (4, 2, "ar", (5, 3)),
         (4, 2, "rs", (5, 1)), (4, 2, "rsv", (3, 5)), (4, 4, "rsv", (2, 0, 3, 1))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy,counts", CASES,
                         ids=[f"tp{t}-dp{d}-{p}" for t, d, p, _ in CASES])
def test_operation_scheduled_microbatches_match_world1(tp, dp, policy, counts):
    ref = world1(counts)
    for rank, r in enumerate(get_pool(tp).run(run, tp, dp, policy, counts)):
        assert r["mode"] == policy and r["released"]
        torch.testing.assert_close(r["out"], ref[slice(*r["rows"])], atol=1e-5, rtol=0,
                                   msg=lambda m: f"rank {rank}: {m}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy,counts", [(2, 1, "rs", (5,)), (4, 2, "rsv", (3, 5)),
                                                 (4, 2, "ar", (5, 3))])
def test_between_sparse_ffns_postprocess_hands_on_the_residuals_rows(tp, dp, policy, counts):
    """(sparse, next_sparse) decides the handoff rows: between sparse FFNs the complete
    output stays on the residual's rows (scattered under rs/rsv, local under ar)."""
    ref = world1(counts)
    for r in get_pool(tp).run(run, tp, dp, policy, counts, True, True):
        torch.testing.assert_close(r["out"], ref[slice(*r["rows"])], atol=1e-5, rtol=0)
        scattered = "attn_dp+attn_tp_scatter" if dp > 1 else "attn_tp_scatter"
        expected = "attn_dp" if policy == "ar" else scattered
        assert set(r["handed_on"]) == {expected}, r["handed_on"]
    dense = get_pool(tp).run(run, tp, dp, policy, counts)[0]
    assert set(dense["handed_on"]) == {"attn_dp" if dp > 1 else "replicated"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy,counts", [(2, 1, "ar", (5,)), (4, 2, "rs", (5, 1)),
                                                 (4, 2, "rsv", (3, 5))])
@pytest.mark.parametrize("accessor", [False, True], ids=["boundary", "complete_output"])
def test_owed_sums_run_asynchronously_between_microbatches(tp, dp, policy, counts, accessor):
    """With exit(), each non-terminal FFN of a microbatch leaves its TP sum in flight when the
    other microbatch's next operation starts; the next boundary, or complete_output(), waits
    for it. Under rs/rsv the terminal FFN's sum is the final norm's reduce-scatter, in flight
    too. The numbers are world 1's."""
    ref = world1(counts)
    for rank, r in enumerate(get_pool(tp).run(run, tp, dp, policy, counts, False, False,
                                              accessor)):
        torch.testing.assert_close(r["out"], ref[slice(*r["rows"])], atol=1e-5, rtol=0)
        # per microbatch: the first layer's FFN sum in flight; the terminal one done in
        # compute under ar, left to the final norm (in flight) under rs/rsv
        terminal = 0 if policy == "ar" else 1
        assert r["in_flight"] == [1, 1, terminal, terminal], (rank, r["in_flight"])


def _two(counts=(4,)):
    rt = runtime()
    stack = ToyStack(rt, layers=LAYERS)
    b, mbs = _microbatches(rt, counts)
    x = seeded((sum(counts), HIDDEN), 8)
    n = mbs[0].num_tokens
    for mb in mbs:
        ResidualStream.arrive(mb)
    return stack, mbs, x[:n], x[n:]


def test_a_stream_shared_between_microbatches_raises():
    stack, (a, b), xa, xb = _two()
    b.boundary.stream = a.residual_stream  # one stream reached through both batches
    stack.layers[0].attn_half(xa, a)
    with pytest.raises(RuntimeError, match=f"^{re.escape(SHARED_STREAM)}$"):
        stack.layers[0].attn_half(xb, b)


def test_an_exit_scope_open_across_a_yield_raises():
    stack, (a, b), xa, xb = _two()
    layer = stack.layers[0]
    state = {}

    def a_attn_then_open_exit():
        layer.ffn.prepare(layer.attn_half(xa, a), a)
        scope = layer.ffn.exit(a)
        scope.__enter__()  # the FFN's exit scope left open at the switch to B
        state["scope"] = scope

    with pytest.raises(RuntimeError, match=f"^{re.escape(EXIT_ACROSS_YIELD)}$"):
        interleave([[a_attn_then_open_exit], [lambda: layer.attn_half(xb, b)]])
    state["scope"].__exit__(None, None, None)


def test_one_microbatchs_output_at_the_others_boundary_raises():
    stack, (a, b), xa, xb = _two()
    layer = stack.layers[0]
    ha = layer.attn_half(xa, a)
    layer.attn_half(xb, b)
    with pytest.raises(RuntimeError, match=f"^{NOT_OURS}$"):
        layer.ffn.prepare(ha, b)


def test_postprocess_misuse():
    stack, (a, b), xa, xb = _two()
    layer = stack.layers[0]
    with pytest.raises(RuntimeError, match="postprocess\\(\\) is for FFN stages"):
        layer.attn.postprocess(xa, a)
    h = layer.attn_half(xa, a)
    with pytest.raises(RuntimeError, match="postprocess\\(\\) on stage layer0.ffn without its "
                                           "prepare\\(\\)"):
        layer.ffn.postprocess(h, a)
    layer.ffn.prepare(h, a)
    with pytest.raises(ValueError, match="takes its complete output on replicated rows"):
        layer.ffn.postprocess(torch.zeros(7, HIDDEN), a)


def plain_run(tp: int, dp: int, policy: str, counts) -> int:
    """The same stack and provider without the overlap: the candidates it accepts."""
    rt = runtime(tp, dp, boundary_reduction=policy)
    provider = ReferenceFusions()
    stack = ToyStack(rt, layers=LAYERS, fusions=provider)
    b = DpBatch(counts, rt)
    residual_batch.start(b.fb)
    h = b.mine(seeded((sum(counts), HIDDEN), 8))
    for layer in stack.layers:
        h = layer.forward_layer(h, b.fb)
    stack.final(h, b.fb)
    return provider.accepted


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy,counts", [(2, 1, "ar", (5,)), (4, 2, "ar", (5, 3)),
                                                 (4, 2, "rsv", (3, 5)), (4, 2, "ar", (0, 4))])
def test_a_provider_completes_owed_sums_under_tbo_as_without_it(tp, dp, policy, counts):
    """With a fusion provider the owed sums are not issued early: its candidate completes them
    at the next input on each microbatch, as it does without the overlap (one per deferred
    FFN sum and microbatch), and the numbers are world 1's."""
    ref = world1(counts)
    accepted = get_pool(tp).run(plain_run, tp, dp, policy, counts)
    for rank, r in enumerate(get_pool(tp).run(run, tp, dp, policy, counts, False, False, False,
                                              True)):
        torch.testing.assert_close(r["out"], ref[slice(*r["rows"])], atol=1e-5, rtol=0,
                                   msg=lambda m: f"rank {rank}: {m}")
        assert r["in_flight"] == [0, 0, 0, 0]
        assert r["fused"] == 2 * accepted[rank] if policy == "ar" else r["fused"] == 0
        if policy == "ar":
            assert r["fused"] > 0


def test_snapshot_of_a_finalize_handoff_under_tbo():
    """The same call means the same thing with and without the overlap: a microbatch's
    finalize handoff stays one, so snapshot() refuses it as it does without TBO."""
    from toy import ToyHandoff

    from layer_boundary import declare_attn, declare_ffn, make_stages
    from layer_boundary.residual.batch import SNAPSHOT_NOT_PLAIN
    from layer_boundary.runtime.norm import RMSNorm

    rt = runtime(1)
    fusions = ReferenceFusions(terminal_finalize=True)
    attn, ffn = make_stages((declare_attn(), RMSNorm(HIDDEN), {"fusions": fusions}),
                            (declare_ffn(sparse=True), RMSNorm(HIDDEN), {"fusions": fusions}),
                            terminal=True, runtime=rt, name="layer0")
    _, (mb, _) = _microbatches(rt, (4,))
    ResidualStream.arrive(mb)
    h = attn.finish(attn.prepare(seeded((mb.num_tokens, HIDDEN), 1), mb) * 0.5, mb)
    h = ffn.prepare(h, mb)
    with ffn.exit(mb) as out:
        handoff = ToyHandoff(h)
    h = out.finish(handoff)
    with pytest.raises(RuntimeError) as info:
        residual_batch.snapshot(h, mb)
    assert str(info.value) == SNAPSHOT_NOT_PLAIN


# ------------------------------------------------------------------ the gate (TboPolicy.AUTO)


@pytest.mark.parametrize("policy,lens,backend,split,reason", [
    (TboPolicy.OFF, ((4, 4), (4, 4)), "nccl", False, "off"),
    (TboPolicy.ALWAYS, ((1,), (1,)), "gloo", True, "always"),
    (TboPolicy.ALWAYS, ((3,),), None, True, "always"),
    (TboPolicy.AUTO, ((4, 4), (4, 4)), "nccl", True, SPLITS),
    (TboPolicy.AUTO, ((4, 4), (1,)), "nccl", False, ONE_SIDED),  # rank 1: one request
    (TboPolicy.AUTO, ((1, 1), ()), "nccl", False, ONE_SIDED),  # an idle DP rank
    (TboPolicy.AUTO, ((64, 64), (64, 64)), "gloo", False, SHARED_CORES),
    (TboPolicy.AUTO, ((4, 4),), None, False, ONE_RANK),
])
def test_auto_splits_only_where_the_overlap_can_pay(policy, lens, backend, split, reason):
    assert tbo_decision(policy, lens, backend) == TboDecision(split, reason)
