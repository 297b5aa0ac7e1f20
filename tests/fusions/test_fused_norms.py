"""Fused norms that cannot corrupt (vLLM#48324, sglang#32807: a norm weight of another dtype,
Gemma's "+1", read by a fused kernel as the model never computes it). Every candidate either
gives the consumer's own add+norm read, in its dtype, or declines and says why."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from toy import HIDDEN, DpBatch, ToyStack, runtime, seeded

from layer_boundary.fusions import Arrival, Declined
from layer_boundary.fusions.reference import ReferenceFusions
from layer_boundary.fusions.triton_provider import TritonFusions
from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual.add_norm import AddNormRead, PlainAdd
from layer_boundary.runtime.norm import GemmaRMSNorm, RMSNorm

WIDTH = 48


ROWS = 5


def _candidate(provider):
    """One add+norm candidate ``provider`` offers a toy stack's input at world 1, and the row
    facts of a forward of ``ROWS`` tokens there."""
    rt = runtime(1, 1, 1, boundary_reduction="ar")
    stack = ToyStack(rt, 2, fusions=provider)
    batch = DpBatch((ROWS,), rt)
    residual_batch.start(batch.fb)
    h = seeded((ROWS, HIDDEN), 0)
    for layer in stack.layers:
        h = layer.forward_layer(h, batch.fb)
    stack.final(h, batch.fb)
    candidate = next(c for _, c in provider.offered)
    return lambda arrival: candidate.run(dataclasses.replace(arrival, facts=batch.fb.row_facts))


def _arrival(norm_cls, weight_dtype, dtype, seed: int = 0) -> Arrival:
    gen = torch.Generator().manual_seed(seed)
    norm = norm_cls(WIDTH, 1e-6, dtype=weight_dtype)
    with torch.no_grad():
        base = 1.0 if norm_cls is RMSNorm else 0.0
        norm.weight.copy_(base + 0.3 * torch.randn(WIDTH, generator=gen))
    value = torch.randn(ROWS, WIDTH, generator=gen).to(dtype)
    residual = torch.randn(ROWS, WIDTH, generator=gen).to(dtype)
    return Arrival(value, None, None, PlainAdd(), residual, None, norm, None)


def _unfused(arrival: Arrival):
    """The consumer's own read of ``arrival``: the fp32 sum, the norm module, its dtype."""
    return AddNormRead().update_and_read(arrival.update, arrival.residual, arrival.value,
                                         arrival.norm)


def _same_read(fused, unfused) -> None:
    for got, want in zip(fused, unfused):
        assert got.dtype == want.dtype
        if want.dtype is torch.float32:
            torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
        else:  # the fp32 statistic may differ in its last bit: one step of the dtype
            step = want.float().abs() * 2 ** -7
            assert ((got.float() - want.float()).abs() <= step + 1e-30).all()


PROVIDERS = {"reference": ReferenceFusions, "triton": TritonFusions}


@pytest.mark.parametrize("provider", PROVIDERS)
def test_an_fp32_weight_on_a_bf16_stream_is_the_modules_read_or_declined_by_name(provider):
    """RMSNorm rounds, then scales: an fp32 weight makes its output fp32 (torch promotes),
    which a kernel writing the stream's bf16 would not reproduce."""
    arrival = _arrival(RMSNorm, torch.float32, torch.bfloat16)
    unfused = _unfused(arrival)
    assert unfused[0].dtype is torch.float32  # what the model's own read gives
    out = _candidate(PROVIDERS[provider]())(arrival)
    if isinstance(out, Declined):
        assert provider == "triton"
        assert out.reason == ("the norm's weight is float32 on a bfloat16 stream (RMSNorm's "
                              "output would be float32, the kernel's bfloat16)")
    else:
        assert provider == "reference"  # the module's own normalize_fp32
        _same_read(out, unfused)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16],
                         ids=["fp32-weight", "bf16-weight"])
def test_a_gemma_norm_scales_by_one_plus_w_in_fp32(provider, weight_dtype):
    """The zero-centered norm: ``norm(x) * (1 + w)`` in fp32, rounded once to the stream's
    dtype, from a weight stored in either dtype; no candidate declines it."""
    arrival = _arrival(GemmaRMSNorm, weight_dtype, torch.bfloat16, seed=1)
    out = _candidate(PROVIDERS[provider]())(arrival)
    assert out, out
    _same_read(out, _unfused(arrival))
    # the "+1" in bf16 (a kernel adding one to a bf16 weight before the product) would not be
    # within one step here: the offset's rounding is what this catches
    w = arrival.norm.weight
    wrong = (arrival.residual.float() + arrival.value.float())
    wrong = torch.nn.functional.rms_norm(wrong, (WIDTH,), eps=1e-6) * (1 + w.to(torch.bfloat16)
                                                                       ).float()
    if weight_dtype is torch.float32:
        assert not torch.equal(wrong.to(torch.bfloat16), out[0])


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_matching_weight_fuses(provider):
    arrival = _arrival(RMSNorm, torch.bfloat16, torch.bfloat16, seed=2)
    out = _candidate(PROVIDERS[provider]())(arrival)
    assert out, out
    _same_read(out, _unfused(arrival))


def test_declines_are_counted_by_reason():
    provider = TritonFusions()
    candidate = _candidate(provider)
    stage = provider.offered[0][0]
    before = provider.outcomes()[stage]["applied"]  # the toy forward's own
    for _ in range(2):
        candidate(_arrival(RMSNorm, torch.float32, torch.bfloat16))
    candidate(_arrival(RMSNorm, torch.bfloat16, torch.bfloat16))
    outcome = provider.outcomes()[stage]
    assert outcome["applied"] == before + 1
    assert outcome["declined"] == {
        "the norm's weight is float32 on a bfloat16 stream (RMSNorm's output would be "
        "float32, the kernel's bfloat16)": 2}
