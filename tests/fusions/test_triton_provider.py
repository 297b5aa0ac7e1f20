"""The Triton provider: its add+norm kernel against the unfused torch ops (under the Triton
interpreter on the CPU: ``tests/conftest.py`` chooses it), its candidates declared from the
consumer's movement table and offered to exactly the arrivals they complete, and a toy stack
on every row mode matching world 1 run without a provider, every stage input after the first
completed by the kernel."""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from offers import offers_not_as_declared
from toy import HIDDEN, DpBatch, ToyStack, cp_case_id, runtime, seeded

from layer_boundary.fusions.triton_provider import TritonFusions
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime.norm import RMSNorm, gemma_rms_fp32
from layer_boundary.runtime.quant import quantize_groups

pytest.importorskip("triton")
from layer_boundary.fusions import kernels  # noqa: E402 - after the interpreter is chosen

LAYERS = 3


def unfused_norm(total, weight, dtype, zero_centered: bool) -> torch.Tensor:
    """What the model's norm module makes of the fp32 sum ``total``."""
    if zero_centered:
        return gemma_rms_fp32(total, weight, 1e-6, dtype)
    norm = RMSNorm(total.shape[-1], 1e-6, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm.normalize_fp32(total, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True], ids=["rmsnorm", "gemma"])
@pytest.mark.parametrize("rows", [0, 1, 5])
def test_the_kernel_computes_the_unfused_add_and_norm(dtype, zero_centered, rows):
    gen = torch.Generator().manual_seed(rows)
    width = 48  # not a power of two: the kernel's padding columns must not count
    full = torch.randn(rows, 2 * width, generator=gen).to(dtype)
    value = full[:, :width]  # strided rows, as a slice of a wider output
    residual = torch.randn(rows, width, generator=gen).to(dtype)
    weight = (torch.randn(width, generator=gen) * 0.1 + (0 if zero_centered else 1)).to(dtype)
    normed, new_residual = kernels.add_rms_norm(value, residual, weight, 1e-6, zero_centered)
    total = residual.float() + value.float()
    expect = unfused_norm(total, weight, dtype, zero_centered)
    assert normed.dtype == new_residual.dtype == dtype
    assert torch.equal(new_residual, total.to(dtype))  # the residual rounded once
    if dtype is torch.float32:
        torch.testing.assert_close(normed, expect, atol=2e-6, rtol=2e-6)
    else:  # the fp32 statistic may differ in its last bit: at most one bf16 step apart
        step = expect.float().abs() * 2 ** -7
        assert ((normed.float() - expect.float()).abs() <= step + 1e-30).all()


def run(tp: int, dp: int, policy: str, counts, provider: bool, cp: int = 1,
        lens=None) -> dict:
    rt = runtime(tp, dp, cp, boundary_reduction=policy)
    fusions = TritonFusions() if provider else None
    stack = ToyStack(rt, LAYERS, fusions=fusions)
    b = DpBatch(counts, rt, lens)
    residual_batch.start(b.fb)
    h = b.mine(seeded((sum(counts), HIDDEN), 4))
    for layer in stack.layers:
        h = layer.forward_layer(h, b.fb)
    out = stack.final(h, b.fb)
    offered = {}
    if provider:
        mode = b.fb.rows.mode
        stages = [s for layer in stack.layers for s in (layer.attn, layer.ffn)]
        for stage in stages[1:]:  # the stack's entry has no producer: no update to fuse
            path = stage.plan.paths[(b.fb.variant, mode)]
            mine = [c for name, c in fusions.offered  # its candidates in this mode
                    if name == stage.name and c.collective is mode
                    and c.target == path.entry.update_rows]
            # each arrival is offered the one candidate declared for its owed sum and rows
            offered[stage.name] = [
                (arrival.candidates == tuple(
                    c for c in mine if c.completes == frozenset({arrival.complete.owed})
                    and c.source == arrival.complete.src), len(arrival.candidates))
                for arrival in path.entry.arrivals.values()]
    every_path = offers_not_as_declared(
        [s for layer in stack.layers for s in (layer.attn, layer.ffn)]) if provider else []
    return {"out": out, "rows": (b.rows.start, b.rows.stop), "mode": b.fb.rows.mode.value,
            "fused": fusions.fused_stages if provider else [], "offered": offered,
            "variant": b.fb.variant.value, "every_path": every_path}


CASES = [(1, 1, "ar", (5,)), (2, 1, "ar", (5,)), (2, 1, "rs", (5,)), (4, 2, "ar", (5, 3)),
         (4, 2, "rs", (5, 3)), (4, 2, "rsv", (3, 5)), (4, 2, "ar", (0, 5)),
         (4, 2, "rsv", (5, 0))]


def check(results, ref, policy: str) -> None:
    inputs = [f"layer{i}.{s}" for i in range(LAYERS) for s in ("attn", "ffn")][1:]
    for rank, r in enumerate(results):
        assert r["mode"] == policy
        torch.testing.assert_close(r["out"], ref[slice(*r["rows"])], atol=1e-5, rtol=0,
                                   msg=lambda m: f"rank {rank}: {m}")
        if r["rows"][1] > r["rows"][0]:  # a rank with no tokens runs no kernel
            assert r["fused"] == inputs, rank
        assert r["every_path"] == [], rank  # every variant and mode the plans built
        for stage, arrivals in r["offered"].items():
            assert all(exact for exact, _ in arrivals), (rank, stage, arrivals)
            assert all(n <= 1 for _, n in arrivals), (rank, stage, arrivals)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp,dp,policy,counts", CASES,
                         ids=[f"tp{t}-dp{d}-{p}-{'_'.join(map(str, c))}" for t, d, p, c in CASES])
def test_every_row_mode_fuses_each_input_and_matches_world1(tp, dp, policy, counts):
    ref = run(1, 1, "ar", counts, False)["out"]
    check(get_pool(tp).run(run, tp, dp, policy, counts, True) if tp > 1 else [
        run(1, 1, policy, counts, True)], ref, policy)


# CP batches: each DP rank's requests (one shorter than 2 x cp; an empty DP rank)
CP_CASES = [(2, 1, 2, "ar", ((7, 2),)), (4, 1, 2, "rs", ((9, 3),)),
            (4, 2, 2, "rsv", ((5, 3), ())), (4, 2, 2, "ar", ((5, 3), (2,)))]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp,dp,cp,policy,lens", CP_CASES,
                         ids=[cp_case_id(*case) for case in CP_CASES])
def test_cp_batches_fuse_each_input_and_match_world1(tp, dp, cp, policy, lens):
    counts = tuple(map(sum, lens))
    ref = run(1, 1, "ar", counts, False)["out"]
    results = get_pool(tp).run(run, tp, dp, policy, counts, True, cp, lens)
    assert {r["variant"] for r in results} == {"CP"}
    check(results, ref, policy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True], ids=["rmsnorm", "gemma"])
@pytest.mark.parametrize("width,group", [(64, 16), (40, 16)], ids=["whole", "partial-group"])
def test_the_fp8_kernel_quantizes_what_the_quantized_read_does(dtype, zero_centered, width,
                                                                group):
    gen = torch.Generator().manual_seed(width)
    value = (torch.randn(6, width, generator=gen) * 3).to(dtype)
    residual = torch.randn(6, width, generator=gen).to(dtype)
    # a row spanning seven decades in each group: fp8's subnormals (below 2^-6 of 448 x scale)
    residual[5] = 0
    value[5] = (10.0 ** -torch.linspace(0, 7, group)).repeat(4)[:width].to(dtype)
    weight = (torch.randn(width, generator=gen) * 0.1 + (0 if zero_centered else 1)).to(dtype)
    values, scales, new_residual = kernels.add_rms_norm_fp8(value, residual, weight, 1e-6,
                                                            group, zero_centered)
    total = residual.float() + value.float()
    x = unfused_norm(total, weight, dtype, zero_centered)
    want = quantize_groups(x, group)
    assert torch.equal(new_residual, total.to(dtype))
    assert values.dtype == torch.float8_e4m3fn and scales.shape == want.scales.shape
    assert (want.values.float().abs() < 2 ** -6).any()  # the subnormal range is exercised
    torch.testing.assert_close(scales, want.scales, atol=0, rtol=2e-7)  # the statistic's bit
    assert torch.equal(values.float(), want.values.float())
    empty = kernels.add_rms_norm_fp8(value[:0], residual[:0], weight, 1e-6, group)
    assert [t.shape[0] for t in empty] == [0, 0, 0]
