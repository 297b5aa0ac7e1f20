"""Every refusal leaves the ledger and the stream as they were.

A refusal that runs a collective first desynchronises the ranks (the peers never join it) and
one that changes the stream first leaves the model holding a handle that no longer belongs to
it. Each case below puts a stream into the state a misuse meets (an owed attention sum, an
FFN output carrying an after-sum transform, a pending handoff) on tp 4 / attention DP 2 with
an idle DP rank, makes the misuse, and checks on every rank: the named error, no collective
recorded, and the stream's handle, contribution and residual the same objects as before; then
the proper next call still runs and gives the numbers of a run without the misuse.
"""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, DpBatch, ToyAttn, ToyFfn, ToyHandoff, runtime, seeded, toy_norm

from layer_boundary import (OutputTransform, declare_attn, declare_ffn, layer_stack,
                            make_stages)
from layer_boundary.adapters.branch import NOT_FORKED, branch_output, merge_branch
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime.ledger import LEDGER


def _softcap(x):
    return 3.0 * torch.tanh(x / 3.0)


SOFTCAP = OutputTransform(_softcap, before_reduce_scatter=False)


class _Setup:
    """Two layers (attention, FFN) on the toy compute; ``transform`` on the first FFN."""

    def __init__(self, tp, dp, counts, policy="ar", ffn_transform=None) -> None:
        self.rt = runtime(tp, dp, boundary_reduction=policy)
        par = self.rt.parallel
        ffn0 = declare_ffn(output_transform=ffn_transform)
        with layer_stack(self.rt):
            self.a0, self.f0 = make_stages((declare_attn(), toy_norm(10)),
                                           (ffn0, toy_norm(20)), name="layer0")
            self.a1, self.f1 = make_stages((declare_attn(), toy_norm(11)),
                                           (declare_ffn(), toy_norm(21)), previous=ffn0,
                                           terminal=True, name="layer1")
        self.attn = [ToyAttn(par, 100), ToyAttn(par, 101)]
        self.ffn = [ToyFfn(par, 200), ToyFfn(par, 201)]
        self.b = DpBatch(counts, self.rt)
        residual_batch.start(self.b.fb)
        self.h = self.b.mine(seeded((sum(counts), HIDDEN), 5))
        self.local = self.h.shape[0]  # this DP rank's rows

    @property
    def fb(self):
        return self.b.fb

    def attn_partial(self, i=0):
        """Through attention i's finish: its attention-TP sum is owed."""
        x = (self.a0, self.a1)[i].prepare(self.h, self.fb)
        self.h = (self.a0, self.a1)[i].finish(self.attn[i](x), self.fb)
        return self.h

    def ffn_left_sum(self):
        """Through the first FFN's exit: it left its TP sum to the next input."""
        self.attn_partial(0)
        x = self.f0.prepare(self.h, self.fb)
        with self.f0.exit(self.fb) as out:
            y = self.ffn[0](x)
        self.h = out.finish(y)
        return self.h

    def finish_forward(self):
        """The rest of the two layers from wherever the first FFN's output is pending."""
        x = self.a1.prepare(self.h, self.fb)
        h = self.a1.finish(self.attn[1](x), self.fb)
        x = self.f1.prepare(h, self.fb)
        with self.f1.exit(self.fb) as out:
            y = self.ffn[1](x)
        return residual_batch.norm(out.finish(y), self.fb, toy_norm(99))


def _snapshot(stream):
    return (stream.handle, stream.contribution, stream.residual, stream.residual_rows,
            None if stream.contribution is None else stream.contribution.value)


def _attempt(s: _Setup, misuse) -> dict:
    """``misuse()`` on ``s``'s stream: what it raised, the collectives it ran, whether the
    stream is the same."""
    stream = s.fb.residual_stream
    before = _snapshot(stream)
    with LEDGER.recording() as entries:
        try:
            misuse()
        except (RuntimeError, TypeError, ValueError) as exc:
            raised = f"{type(exc).__name__}: {exc}"
        else:
            raised = None
    after = _snapshot(stream)
    return {"raised": raised, "ledger": len(entries),
            "untouched": all(a is b for a, b in zip(before, after))}


# name -> (setup kwargs, state, misuse, expected error text (a substring))
def _cases():
    def wrong_handle(s):
        return s.a1.prepare(s.h.clone() if isinstance(s.h, torch.Tensor) else object(), s.fb)

    return {
        "capture_output on a transformed update": (
            {"ffn_transform": SOFTCAP}, "ffn_left_sum",
            lambda s: s.a1.capture_output(s.h, s.fb),
            "snapshot requires a plain residual update"),
        "snapshot of a transformed update": (
            {"ffn_transform": SOFTCAP}, "ffn_left_sum",
            lambda s: residual_batch.snapshot(s.h, s.fb),
            "snapshot requires a plain residual update"),
        "add_to_output on a transformed update": (
            {"ffn_transform": SOFTCAP}, "ffn_left_sum",
            lambda s: residual_batch.add_to_output(s.h, s.fb,
                                                   torch.ones(s.local, HIDDEN)),
            "add_to_output() requires a plain residual update"),
        "post_residual_addition on a transformed update": (
            {"ffn_transform": SOFTCAP}, "ffn_left_sum",
            lambda s: s.a1.prepare(s.h, s.fb,
                                   post_residual_addition=torch.ones(s.local, HIDDEN)),
            "post_residual_addition requires a plain residual update"),
        "post_residual_addition on the wrong rows": (
            {}, "ffn_left_sum",
            lambda s: s.a1.prepare(s.h, s.fb,
                                   post_residual_addition=torch.ones(s.local + 1,
                                                                     HIDDEN)),
            "post_residual_addition has"),
        "add_to_output on the wrong rows": (
            {}, "ffn_left_sum",
            lambda s: residual_batch.add_to_output(s.h, s.fb,
                                                   torch.ones(s.local + 1, HIDDEN)),
            "add_to_output()'s extra has"),
        "prepare with another output": (
            {}, "ffn_left_sum", wrong_handle, "output does not belong to this residual stream"),
        "capture_output with another output": (
            {}, "ffn_left_sum", lambda s: s.a1.capture_output(object(), s.fb),
            "output does not belong to this residual stream"),
        "FFN prepare with capture_output": (
            {}, "attn_partial", lambda s: s.f0.prepare(s.h, s.fb, capture_output=[].append),
            "FFN prepare() does not accept capture_output"),
        "prepare of the stage after next": (
            {}, "attn_partial", lambda s: s.a1.prepare(object(), s.fb),
            "output does not belong to this residual stream"),
        "take_output while pending": (
            {}, "attn_partial", lambda s: residual_batch.take_output(s.h, s.fb),
            "write the residual update before taking the final output"),
        "finish on a SCOPED FFN": (
            {}, "ffn_prepared", lambda s: s.f0.finish(torch.zeros(0), s.fb),
            "publish its output through exit(), not finish()"),
        "finish without prepare": (
            {}, "attn_partial", lambda s: s.a1.finish(torch.zeros(0), s.fb),
            "finish() on stage layer1.attn without its prepare()"),
        "exit without prepare": (
            {}, "attn_partial", lambda s: s.f1.exit(s.fb),
            "exit() on stage layer1.ffn without its prepare()"),
        "postprocess without prepare": (
            {}, "attn_partial", lambda s: s.f1.postprocess(torch.zeros(0), s.fb),
            "postprocess() on stage layer1.ffn without its prepare()"),
        "postprocess on an attention": (
            {}, "attn_partial", lambda s: s.a1.postprocess(torch.zeros(0), s.fb),
            "postprocess() is for FFN stages"),
        "from_pp on a stream in use": (
            {}, "attn_partial", lambda s: s.a1.from_pp({"residual": torch.zeros(0)}, s.fb),
            "this stream is already in use"),
        "written() with the wrong rows": (
            {}, "attn_partial",
            lambda s: residual_batch.written(torch.ones(s.local + 1, HIDDEN), s.fb),
            "written()'s hidden_states has"),
        "to_compute_rows with the wrong rows": (
            {}, "attn_partial",
            lambda s: s.a1.to_compute_rows(torch.ones(s.local + 1), s.fb),
            "to_compute_rows()'s tensor has"),
        "branch_output outside a branch": (
            {}, "attn_partial", lambda s: branch_output(s.h, s.fb),
            NOT_FORKED.format(call="branch_output()")),
        "merge_branch outside a branch": (
            {}, "attn_partial", lambda s: merge_branch(s.h, s.h, s.fb),
            NOT_FORKED.format(call="merge_branch()")),
        "norm with a handoff service and a capture": (
            {}, "handoff_pending",
            lambda s: residual_batch.norm(s.h, s.fb, toy_norm(99),
                                          handoff_norm=_NeverService(),
                                          capture_output=[].append),
            "does not accept capture_output"),
        "exit finish with a handoff it did not allow": (
            {}, "exit_open",
            lambda s: s.exit_scope.finish(ToyHandoff(torch.zeros(s.local, HIDDEN))),
            "did not publish defer_moe_finalize"),
        "exit finish with another dtype": (
            {}, "exit_open",
            lambda s: s.exit_scope.finish(s.exit_output.double()),
            "returned a torch.float64 output"),
    }


class _NeverService:
    calls = 0

    def finalize(self, handoff, residual, gamma):  # pragma: no cover - never reached
        raise AssertionError("the refusal comes first")


def _state(s: _Setup, state: str) -> None:
    if state == "attn_partial":
        s.attn_partial(0)
    elif state == "ffn_left_sum":
        s.ffn_left_sum()
    elif state == "ffn_prepared":
        s.attn_partial(0)
        s.f0.prepare(s.h, s.fb)
    elif state == "exit_open":
        s.attn_partial(0)
        x = s.f0.prepare(s.h, s.fb)
        s.exit_scope = s.f0.exit(s.fb)
        with s.exit_scope:
            s.exit_output = s.ffn[0](x)
    elif state == "handoff_pending":
        s.attn_partial(0)
        s.f0.prepare(s.h, s.fb)
        stream = s.fb.residual_stream
        # a pending finalize handoff, as an FFN that deferred it leaves one
        s.h = stream.leave(ToyHandoff(torch.zeros(s.local, HIDDEN)), None,
                           s.f0.declaration.residual.update, s.fb.rows.layouts.local,
                           handoff=True)
    else:  # pragma: no cover
        raise AssertionError(state)


def attempt_case(name: str, tp: int, dp: int, counts) -> dict:
    kwargs, state, misuse, _ = _cases()[name]
    s = _Setup(tp, dp, counts, **kwargs)
    _state(s, state)
    return _attempt(s, lambda: misuse(s))


CASE_NAMES = sorted(_cases())


@pytest.mark.parametrize("name", CASE_NAMES)
def test_a_refusal_runs_no_collective_and_leaves_the_stream(name):
    expected = _cases()[name][3]
    for rank, r in enumerate(get_pool(4).run(attempt_case, name, 4, 2, (0, 5))):
        assert r["raised"] is not None and expected in r["raised"], (rank, r)
        assert r["ledger"] == 0, (rank, r)
        assert r["untouched"], (rank, r)


def after_refused_capture(tp: int, dp: int, counts, refuse: bool) -> dict:
    """The refused capture_output, then the forward as if it had not been tried."""
    s = _Setup(tp, dp, counts, ffn_transform=SOFTCAP)
    s.ffn_left_sum()
    if refuse:
        try:
            s.a1.capture_output(s.h, s.fb)
        except RuntimeError:
            pass
        else:  # pragma: no cover
            raise AssertionError("capture_output took a transformed update")
    return {"out": s.finish_forward(), "rows": (s.b.rows.start, s.b.rows.stop)}


@pytest.mark.parametrize("tp,dp,policy_counts", [(2, 1, (5,)), (4, 2, (0, 5)), (4, 2, (5, 3))])
def test_the_handle_still_serves_after_a_refused_capture(tp, dp, policy_counts):
    plain = get_pool(tp).run(after_refused_capture, tp, dp, policy_counts, False)
    refused = get_pool(tp).run(after_refused_capture, tp, dp, policy_counts, True)
    for a, b in zip(plain, refused):
        torch.testing.assert_close(a["out"], b["out"], atol=0, rtol=0)
