"""The fusion-provider protocol on real stages: candidate order, declining without touching
inputs, the finalize handoff and its misuse."""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, ToyHandoff, ToyLayer, batch, runtime

from layer_boundary import declare_attn, declare_ffn, make_stages
from layer_boundary.fusions.reference import ReferenceFusions, fused_finalize_all_reduce_add_norm
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime.norm import GemmaRMSNorm, RMSNorm


class Recorder:
    """A candidate that declines, remembering copies of what it was shown."""

    def __init__(self) -> None:
        self.seen = []

    def __call__(self, arrival):
        self.seen.append((arrival.value.clone(), arrival.residual.clone()))
        return None


class Checker:
    """The next candidate: declines too, after checking it sees what the recorder saw."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder, self.matches = recorder, []

    def __call__(self, arrival):
        value, residual = self.recorder.seen[-1]
        self.matches.append(torch.equal(arrival.value, value)
                            and torch.equal(arrival.residual, residual))
        return None


class DeclineThenFuse(ReferenceFusions):
    def __init__(self) -> None:
        super().__init__()
        self.checkers = []

    def _input(self, plan):
        recorder = Recorder()
        checker = Checker(recorder)
        self.checkers.append(checker)
        # declared like the reference candidate, so offered to the same arrivals
        return [fused_finalize_all_reduce_add_norm(plan, recorder),
                fused_finalize_all_reduce_add_norm(plan, checker), *super()._input(plan)]


def toy_run(tp: int, provider: str | None) -> dict:
    fusions = {None: None, "reference": ReferenceFusions(),
               "decline-then-fuse": DeclineThenFuse()}[provider]
    rt = runtime(tp)
    layers = [ToyLayer(rt, i, 3, fusions=fusions) for i in range(3)]
    fb = batch(5)
    residual_batch.start(fb)
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))
    for layer in layers:
        h = layer.forward_layer(h, fb)
    result = {"out": residual_batch.norm(h, fb, RMSNorm(HIDDEN)), "fused": 0, "untouched": True,
              "declined": 0}
    if fusions is not None:
        result["fused"] = fusions.accepted
    if provider == "decline-then-fuse":
        matches = [m for c in fusions.checkers for m in c.matches]
        result["declined"] = len(matches)
        # what a declining candidate was shown is exactly what the next one got: unmodified
        result["untouched"] = all(matches)
    return result


@pytest.mark.timeout(60)
def test_candidates_run_in_order_and_fusion_gives_identical_numbers():
    plain = get_pool(2).run(toy_run, 2, None)
    for provider in ("reference", "decline-then-fuse"):
        for r, p in zip(get_pool(2).run(toy_run, 2, provider), plain):
            assert torch.equal(r["out"], p["out"])
            # two deferred FFN all-reduces (layers 0 and 1) completed by the fused candidate
            assert r["fused"] == 2
            assert r["untouched"]
        if provider == "decline-then-fuse":
            # every pending input was shown to the declining recorder first
            assert r["declined"] >= 2


def _sparse_stack():
    rt = runtime(1)
    fusions = ReferenceFusions(terminal_finalize=True)
    attn, ffn = make_stages((declare_attn(), RMSNorm(HIDDEN), {"fusions": fusions}),
                            (declare_ffn(sparse=True), RMSNorm(HIDDEN), {"fusions": fusions}),
                            terminal=True, runtime=rt, name="layer0")
    fb = batch(3)
    residual_batch.start(fb)
    h = attn.prepare(torch.ones(3, HIDDEN), fb)
    h = attn.finish(h * 0.5, fb)
    h = ffn.prepare(h, fb)
    with ffn.exit(fb) as out:
        assert out.defer_moe_finalize  # the provider accepted a terminal finalize
        handoff = ToyHandoff(h)
    return out.finish(handoff), fb, fusions


def test_snapshot_of_a_finalize_handoff():
    h, fb, _ = _sparse_stack()
    with pytest.raises(RuntimeError, match="^snapshot requires a plain residual update$"):
        residual_batch.snapshot(h, fb)


def _gemma_norm():
    norm = GemmaRMSNorm(HIDDEN, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, HIDDEN))
    return norm


def test_handoff_norm_rejects_capture_and_otherwise_finalizes():
    h, fb, fusions = _sparse_stack()
    service = fusions.handoff_norm(1e-5)
    with pytest.raises(RuntimeError, match="^norm\\(\\) with handoff_norm does not accept "
                                           "capture_output when a handoff arrives$"):
        residual_batch.norm(h, fb, _gemma_norm(), handoff_norm=service,
                            capture_output=lambda value, owned=False: None)
    h, fb, fusions = _sparse_stack()
    service = fusions.handoff_norm(1e-5)
    out = residual_batch.norm(h, fb, _gemma_norm(), handoff_norm=service)
    h2, fb2, _ = _sparse_stack()
    unfused = residual_batch.norm(h2, fb2, _gemma_norm())  # completes the handoff itself
    assert service.calls == 1
    torch.testing.assert_close(out, unfused, atol=0, rtol=0)


def test_handoff_norm_is_asked_only_for_a_zero_centered_norm_and_may_decline():
    """The fused path reads the final norm's gemma_weight: an RMSNorm final norm completes the
    handoff unfused without asking the service; a service returning None leaves the handoff
    to the same unfused completion, untouched."""
    asked = []

    class Declining:
        def finalize(self, handoff, residual, gamma):
            asked.append((handoff, residual.clone(), gamma))
            return None

    h, fb, fusions = _sparse_stack()
    service = fusions.handoff_norm(1e-6)
    plain = residual_batch.norm(h, fb, RMSNorm(HIDDEN), handoff_norm=service)
    h2, fb2, _ = _sparse_stack()
    torch.testing.assert_close(plain, residual_batch.norm(h2, fb2, RMSNorm(HIDDEN)),
                               atol=0, rtol=0)
    assert service.calls == 0  # not asked: no gemma_weight to read

    h, fb, _ = _sparse_stack()
    residual = fb.residual_stream.residual.clone()
    declined = residual_batch.norm(h, fb, _gemma_norm(), handoff_norm=Declining())
    h2, fb2, _ = _sparse_stack()
    torch.testing.assert_close(declined, residual_batch.norm(h2, fb2, _gemma_norm()),
                               atol=0, rtol=0)
    (handoff, seen, gamma), = asked
    assert isinstance(handoff, ToyHandoff) and torch.equal(seen, residual)
    assert gamma is not None


def test_handoff_norm_needs_its_stages_built():
    with pytest.raises(RuntimeError, match="^handoff_norm\\(\\) needs the provider installed"):
        ReferenceFusions(terminal_finalize=True).handoff_norm()


# ------------------------------------------------ candidates meet only what they declare


class ScaledRead:
    """A custom read (no fusable kind): the norm of the residual, scaled."""

    before_gather = False
    kind = None

    def enter(self, hidden, norm):
        return norm(hidden) * 1.5, hidden

    def read(self, residual, norm):
        return norm(residual) * 1.5, residual

    def update_and_read(self, update, residual, contribution, norm):
        return self.read(update.apply(residual, contribution), norm)


def declared_run(tp: int, dp: int, policy: str, counts, variant: str, provider: bool) -> dict:
    from test_errors import ScaledUpdate
    from toy import DpBatch, ToyStack, seeded

    kwargs = {"custom-read": {"attn_read": ScaledRead(), "ffn_read": ScaledRead()},
              "nonlinear-update": {"ffn_update": ScaledUpdate()}, "plain": {}}[variant]
    fusions = ReferenceFusions() if provider else None
    rt = runtime(tp, dp, boundary_reduction=policy)
    stack = ToyStack(rt, 3, fusions=fusions, **kwargs)
    b = DpBatch(counts, rt)
    residual_batch.start(b.fb)
    h = b.mine(seeded((sum(counts), HIDDEN), 4))
    for layer in stack.layers:
        h = layer.forward_layer(h, b.fb)
    return {"out": stack.final(h, b.fb), "rows": (b.rows.start, b.rows.stop),
            "accepted": fusions.accepted if provider else 0, "mode": b.fb.rows.mode.value}


DECLARED_CASES = [(2, 1, "ar", (5,)), (2, 1, "rs", (5,)), (4, 2, "ar", (5, 3)),
                  (4, 2, "rs", (5, 0)), (4, 2, "rsv", (3, 5))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["custom-read", "nonlinear-update", "plain"])
@pytest.mark.parametrize("tp,dp,policy,counts", DECLARED_CASES,
                         ids=[f"tp{t}-dp{d}-{p}" for t, d, p, _ in DECLARED_CASES])
def test_candidates_are_offered_only_where_they_apply(tp, dp, policy, counts, variant):
    """A custom read or a nonlinear update never reaches the plain add+norm kernel, nor do
    reduce-scattered sums; with the declared read and update under ar, the deferred FFN sums
    of layers 0 and 1 are fused, with the same numbers as world 1 without a provider."""
    ref = declared_run(1, 1, "ar", counts, variant, False)
    for r in get_pool(tp).run(declared_run, tp, dp, policy, counts, variant, True):
        assert r["mode"] == policy
        torch.testing.assert_close(r["out"], ref["out"][slice(*r["rows"])], atol=1e-5, rtol=0)
        fused = variant == "plain" and policy == "ar"
        assert r["accepted"] == (2 if fused else 0), r["accepted"]
