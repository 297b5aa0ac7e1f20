"""Declarations do what they say or are rejected at construction; stream identity holds.

- ``StageUpdate.at_producer``: the update is applied at the producer's exit and the handle it
  returns is complete, with the same numbers as a consumer-side update, on every row mode.
- ``gathers_tp_input=False`` has no latent hook inside an input gather; ``next_sparse`` must
  agree with the FFN it describes; a transition the movement table lacks is rejected when
  the stage is built, naming the stage.
- An initial stream accepts only the stack's input; a second ``exit()`` after one
  ``prepare()`` raises.
"""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, AddAtProducer, DpBatch, ToyStack, batch, runtime, seeded

from layer_boundary import (ProducerReduction, declare_attn, declare_ffn, layer_stack,
                            make_stages)
from layer_boundary import ops
from layer_boundary.construction import UnsupportedBoundary
from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual.stream import NOT_OURS, OwedOutput, StreamState
from layer_boundary.runtime import RMSNorm


def producer_run(tp: int, dp: int, policy: str, counts, at_producer: bool) -> dict:
    rt = runtime(tp, dp, boundary_reduction=policy)
    update = AddAtProducer() if at_producer else None
    stack = ToyStack(rt, 3, ffn_update=update)
    b = DpBatch(counts, rt)
    residual_batch.start(b.fb)
    h = b.mine(seeded((sum(counts), HIDDEN), 5))
    handles = []
    for layer in stack.layers:
        h = layer.forward_layer(h, b.fb)
        handles.append((type(h).__name__, b.fb.residual_stream.state.value))
    return {"out": stack.final(h, b.fb), "handles": handles, "rows": (b.rows.start, b.rows.stop)}


CASES = [(2, 1, "ar", (5,)), (2, 1, "rs", (5,)), (4, 2, "ar", (5, 3)), (4, 2, "rs", (5, 0)),
         (4, 2, "rsv", (3, 5))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy,counts", CASES,
                         ids=[f"tp{t}-dp{d}-{p}" for t, d, p, _ in CASES])
def test_update_at_producer_is_applied_at_the_exit(tp, dp, policy, counts):
    ref = producer_run(1, 1, "ar", counts, False)
    for r in get_pool(tp).run(producer_run, tp, dp, policy, counts, True):
        torch.testing.assert_close(r["out"], ref["out"][slice(*r["rows"])], atol=1e-5, rtol=0)
        # every FFN exit hands back a complete tensor and leaves the stream written
        assert r["handles"] == [("Tensor", StreamState.WRITTEN.value)] * 3


def test_latent_hook_needs_the_attentions_own_gather():
    mixer = declare_attn(reduction=ProducerReduction.SCOPED, gathers_tp_input=False)
    with pytest.raises(UnsupportedBoundary, match="gathers_tp_input=False"):
        make_stages((mixer, RMSNorm(HIDDEN), {"qkv_latent_func": abs}), runtime=runtime())


def test_next_sparse_must_match_the_ffn_it_describes():
    previous = declare_ffn(sparse=True, next_sparse=False)
    with pytest.raises(ValueError, match="previous declares next_sparse=False, but the next "
                                         "FFN \\(item 1\\) is declared sparse=True"):
        make_stages((declare_attn(), RMSNorm(HIDDEN)),
                    (declare_ffn(sparse=True), RMSNorm(HIDDEN)), previous=previous,
                    runtime=runtime())
    # agreeing neighbours build
    make_stages((declare_attn(), RMSNorm(HIDDEN)), (declare_ffn(sparse=False), RMSNorm(HIDDEN)),
                previous=previous, runtime=runtime())


def build_without(primitive: str, policy: str) -> str:
    """Build a toy layer with the table rows of one primitive (``ops.<primitive>``) removed;
    the construction error, or ''."""
    saved = ops.TRANSITIONS
    rt = runtime(2, boundary_reduction=policy)
    ops.TRANSITIONS = tuple(t for t in saved if t.primitive is not getattr(ops, primitive))
    rt.parallel.memo.clear()  # the tables resolved from the full TRANSITIONS
    try:
        ToyStack(rt, 2)
        return ""
    except UnsupportedBoundary as exc:
        return str(exc)
    finally:
        ops.TRANSITIONS = saved
        rt.parallel.memo.clear()


@pytest.mark.timeout(60)
def test_a_transition_missing_from_the_table_is_rejected_at_construction():
    got = get_pool(2).run(build_without, "REDUCE_SCATTER_TP", "rs")
    assert all(g.startswith("stage layer1.attn: no row movement takes a sum over tp on "
                            "replicated rows to attn_tp_scatter rows in rs mode") for g in got), got
    assert get_pool(2).run(build_without, "REDUCE_SCATTER_TP", "ar") == ["", ""]


# ------------------------------------------------------------------ stream identity


def _started(tokens=3):
    stack, fb = ToyStack(runtime(), 2), batch(tokens)
    residual_batch.start(fb)
    return stack, fb


@pytest.mark.parametrize("call", [
    lambda fb, x, s: residual_batch.complete_output(x, fb),
    lambda fb, x, s: residual_batch.fold(x, fb),
    lambda fb, x, s: residual_batch.snapshot(x, fb),
    lambda fb, x, s: residual_batch.add_to_output(x, fb, x),
    lambda fb, x, s: residual_batch.take_output(x, fb),
    lambda fb, x, s: residual_batch.norm(x, fb, RMSNorm(HIDDEN)),
    lambda fb, x, s: s.layers[0].attn.capture_output(x, fb),
], ids=["complete_output", "fold", "snapshot", "add_to_output", "take_output", "norm",
        "capture_output"])
def test_an_initial_stream_accepts_no_tensor(call):
    stack, fb = _started()
    with pytest.raises(RuntimeError, match=f"^{NOT_OURS.replace('(', '.').replace(')', '.')}$"):
        call(fb, torch.randn(3, HIDDEN), stack)


def test_an_initial_stream_takes_only_the_stack_input():
    stack, fb = _started()
    with pytest.raises(RuntimeError, match="stage layer0.ffn has a previous producer but the "
                                           "stream holds no residual"):
        stack.layers[0].ffn.prepare(torch.randn(3, HIDDEN), fb)
    with pytest.raises(RuntimeError, match=f"^{NOT_OURS}$"):
        stack.layers[0].attn.prepare(OwedOutput(fb.residual_stream), fb)
    with pytest.raises(ValueError, match="the input of stage layer0.attn has 4 rows; this DP "
                                         "rank holds 3 tokens"):
        stack.layers[0].attn.prepare(torch.randn(4, HIDDEN), fb)


def test_a_second_exit_after_one_prepare_raises():
    stack, fb = _started()
    layer = stack.layers[0]
    h = layer.ffn.prepare(layer.attn_half(torch.randn(3, HIDDEN), fb), fb)
    first = layer.ffn.exit(fb)
    with pytest.raises(RuntimeError, match="^exit\\(\\) on stage layer0.ffn without its "
                                           "prepare\\(\\)$"):
        layer.ffn.exit(fb)
    with first:
        y = layer.ffn_compute(h)
    first.finish(y)  # the first scope still finishes, once


# ------------------------------------------------------------------ neighbours agree


MIXER = declare_attn(reduction=ProducerReduction.SCOPED, gathers_tp_input=False)


def _block(decl, previous, following, rt, i, terminal=False):
    return make_stages((decl, RMSNorm(HIDDEN)), previous=previous, following=following,
                       terminal=terminal, runtime=rt, name=f"block{i}")


def test_a_misdeclared_neighbour_is_rejected_naming_both_stages():
    rt = runtime()
    with layer_stack(rt):  # the stack knows which stage was built before which
        kept = _block(MIXER, None, declare_ffn(), rt, 0)  # a model holds its stages
        with pytest.raises(UnsupportedBoundary,
                           match="stage block0.attn declares following=ffn \\(SCOPED\\), but "
                                 "the next stage, block1.attn, is attention \\(SCOPED\\)"):
            _block(MIXER, MIXER, None, rt, 1, terminal=True)
    with layer_stack(rt):
        kept = _block(MIXER, None, MIXER, rt, 0)
        with pytest.raises(UnsupportedBoundary,
                           match="stage block1.attn declares previous=ffn \\(SCOPED\\), but "
                                 "its producer, stage block0.attn, is attention \\(SCOPED\\)"):
            _block(MIXER, declare_ffn(), None, rt, 1, terminal=True)
    with layer_stack(rt):
        # neighbours that describe each other build; a new stack starts afresh
        kept = _block(MIXER, None, declare_ffn(sparse=True), rt, 0)
        kept += _block(declare_ffn(sparse=True), MIXER, None, rt, 1, terminal=True)
        _block(MIXER, None, None, rt, 0, terminal=True)
    assert len(kept) == 2


def test_a_neighbour_differing_only_in_next_sparse_is_named_by_that_field():
    """Both sides describe as "ffn (SCOPED)": the error names the field that differs."""
    rt = runtime()

    def layer(i, previous, ffn):
        return make_stages((declare_attn(), RMSNorm(HIDDEN)), (ffn, RMSNorm(HIDDEN)),
                           previous=previous, runtime=rt, name=f"layer{i}")

    with layer_stack(rt):
        kept = layer(0, None, declare_ffn(next_sparse=True))
        with pytest.raises(UnsupportedBoundary) as info:
            layer(1, declare_ffn(), declare_ffn(sparse=True))
    assert str(info.value) == (
        "stage layer1.attn declares previous=ffn (SCOPED), but its producer, stage layer0.ffn, "
        "is ffn (SCOPED): they differ in next_sparse (declared None, built True)")
    assert kept
