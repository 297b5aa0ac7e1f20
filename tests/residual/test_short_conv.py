"""The short-convolution residual kind (residual/short_conv.py) through the boundaries.

A toy stack whose every producer (a PARTIAL attention, a real row-parallel FFN) declares
``ShortConvUpdate`` with a convolution of its own. World 1 equals the same layers written out
in plain torch (``h = h + y + conv(y)`` per request, ``y = compute(norm(h))``), for a prefill
of several requests and a decode step that continues each request's cached window; under
``ar`` with attention TP and attention DP (a DP rank with no tokens too) every rank equals
world 1. A runtime that would scatter the residual over attention TP is refused at
construction, by name; so is an update applied without the forward it runs in.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from distributed.pool import get_pool
from torch import nn
from toy import HIDDEN, ToyAttn, ToyFfn, attn_weights, runtime, seeded, toy_norm

from layer_boundary import append_stages, declare_attn, declare_ffn, layer_stack
from layer_boundary.layout import RowMode
from layer_boundary.ops import UnsupportedBoundary
from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual.batch import SNAPSHOT_NOT_PLAIN
from layer_boundary.residual.short_conv import (NO_FORWARD, SHORT_CONV_ROWS, ShortConv,
                                                ShortConvState, ShortConvUpdate)
from layer_boundary.runtime import (BatchVariant, BoundaryRuntime, ForwardBatch, ForwardMode,
                                    ParallelDims)
from layer_boundary.runtime.parallel import virtual_parallel

LAYERS, KERNEL = 3, 4
KEYS = [f"layer{i}.{a}" for i in range(LAYERS) for a in ("attn_sconv", "mlp_sconv")]
# every DP rank's requests' prompt lengths (world 1 runs them all, in DP order)
REQUESTS = ((5, 2), (3, 1))
DP_EMPTY = ((5, 2, 3), ())


def conv(seed: int) -> ShortConv:
    module = ShortConv(HIDDEN, KERNEL)
    with torch.no_grad():
        module.conv1d.weight.copy_(0.5 * attn_weights(1, seed)[0, :, :KERNEL, None]
                                   .transpose(1, 2))
    return module


def cache(slots: int) -> SimpleNamespace:
    """What a model's cache holds for the updates: every convolution's windows."""
    return SimpleNamespace(short_conv=ShortConvState(slots, dict.fromkeys(KEYS, HIDDEN), KERNEL))


def declarations(layer, i: int) -> tuple:
    return (declare_attn(update=ShortConvUpdate.of(layer, "attn_sconv", i)),
            declare_ffn(update=ShortConvUpdate.of(layer, "mlp_sconv", i)))


class ConvLayer(nn.Module):
    def __init__(self, rt, i: int):
        super().__init__()
        par = rt.parallel
        self.attn_norm, self.ffn_norm = toy_norm(100 + i), toy_norm(200 + i)
        self.attn_c, self.ffn_c = ToyAttn(par, 300 + i), ToyFfn(par, 400 + i)
        self.attn_sconv, self.mlp_sconv = conv(500 + i), conv(600 + i)
        attn, ffn = declarations(self, i)
        self.attn, self.ffn = append_stages((attn, self.attn_norm), (ffn, self.ffn_norm),
                                            name=f"layer{i}")

    def forward(self, h, fb):
        h = self.attn.finish(self.attn_c(self.attn.prepare(h, fb)), fb)
        h = self.ffn.prepare(h, fb)
        with self.ffn.exit(fb) as out:
            y = self.ffn_c(h)
        return out.finish(y)


def build(rt):
    with layer_stack(rt):
        layers = [ConvLayer(rt, i) for i in range(LAYERS)]
    return layers, toy_norm(99)


def by_hand(x: torch.Tensor, lens) -> torch.Tensor:
    """The world-1 stack in plain torch over whole requests (rows of ``x`` in order):
    h = h + y + causal_depthwise_conv(y) per request, y = compute(norm(h)) per stage."""
    layers, final = build(runtime())

    def sconv(module, y):  # each request alone, zero-padded on the left
        out, start = [], 0
        for n in lens:
            part = y[start:start + n].t()[None]  # [1, C, n]
            padded = F.pad(part, (KERNEL - 1, 0))
            out.append((part + F.conv1d(padded, module.conv1d.weight, groups=HIDDEN))[0].t())
            start += n
        return torch.cat(out)

    h = x
    with torch.no_grad():
        for layer in layers:
            h = h + sconv(layer.attn_sconv, layer.attn_c(layer.attn_norm(h)))
            h = h + sconv(layer.mlp_sconv, layer.ffn_c(layer.ffn_norm(h)))
        return final(h)


def forward(rt, layers, final, fb, x):
    residual_batch.start(fb)
    h = x
    for layer in layers:
        h = layer(h, fb)
    out = residual_batch.norm(h, fb, final)  # which applies the last layer's update
    return out, fb.row_facts.mode.value, fb.residual_stream is None


def run(tp: int, dp: int, requests, policy: str = "ar") -> dict:
    """A prefill of every DP rank's requests, then one decode step (one token each, its
    window read from the cache): this rank's rows of both, the row mode, the release."""
    rt = runtime(tp, dp, boundary_reduction=policy)
    layers, final = build(rt)
    par = rt.parallel
    d = par.attn_dp_rank if dp > 1 else 0
    requests = requests if dp > 1 else (tuple(n for per in requests for n in per),)
    mine = requests[d]
    counts = tuple(map(sum, requests))
    first = sum(counts[:d])
    total = sum(counts)
    state = cache(max(1, len(mine)))
    prefill = ForwardBatch.build(ForwardMode.EXTEND, [[0] * n for n in mine], [0] * len(mine),
                                 dp_token_counts=counts, kv_cache=state)
    x = seeded((total, HIDDEN), 8)
    with torch.no_grad():
        out, mode, released = forward(rt, layers, final, prefill, x[first:first + counts[d]])
        steps = tuple(len(per) for per in requests)
        decode = ForwardBatch.build(ForwardMode.DECODE, [[0]] * len(mine), list(mine),
                                    dp_token_counts=steps, kv_cache=state)
        y = seeded((sum(steps), HIDDEN), 9)
        start = sum(steps[:d])
        step, _, step_released = forward(rt, layers, final, decode, y[start:start + steps[d]])
    return {"prefill": out, "decode": step, "mode": mode, "dp_rank": d,
            "released": released and step_released,
            "ffn_entry": layers[0].ffn.describe(getattr(RowMode, mode.upper()))["entry"]}


def reference(requests) -> dict:
    """World 1's prefill and decode of the same requests, and plain torch's of each request's
    prompt and its decode token together."""
    w1 = run(1, 1, requests)
    lens = [n for per in requests for n in per]
    x, y = seeded((sum(lens), HIDDEN), 8), seeded((len(lens), HIDDEN), 9)
    rows, start = [], 0
    for j, n in enumerate(lens):  # each request's prompt rows, then its decode row
        rows += [x[start:start + n], y[j:j + 1]]
        start += n
    whole = by_hand(torch.cat(rows), [n + 1 for n in lens])
    ends = torch.tensor([sum(n + 1 for n in lens[:j + 1]) - 1 for j in range(len(lens))])
    prompts = torch.ones(whole.shape[0], dtype=torch.bool)
    prompts[ends] = False
    return {"world1": w1, "prefill": whole[prompts], "decode": whole[ends]}


def test_world1_is_the_short_conv_written_out():
    ref = reference(REQUESTS)
    w1 = ref["world1"]
    torch.testing.assert_close(w1["prefill"], ref["prefill"], atol=1e-5, rtol=0)
    torch.testing.assert_close(w1["decode"], ref["decode"], atol=1e-5, rtol=0)
    assert w1["mode"] == "ar" and w1["released"]


# (tp, dp, policy, requests): attention TP and DP, an empty DP rank, every row mode; under
# rs/rsv each entry completes the output onto the DP rank's own rows to convolve it
CASES = [(2, 1, "ar", REQUESTS), (2, 2, "ar", DP_EMPTY), (4, 2, "ar", REQUESTS),
         (2, 1, "rs", REQUESTS), (4, 2, "rs", DP_EMPTY), (4, 2, "rsv", DP_EMPTY)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy,requests", CASES,
                         ids=[f"tp{t}-dp{d}-{p}" for t, d, p, _ in CASES])
def test_every_row_mode_matches_world1(tp, dp, policy, requests):
    ref = reference(requests)["world1"]
    counts = [sum(per) for per in requests] if dp > 1 else [sum(map(sum, requests))]
    steps = [len(per) for per in requests] if dp > 1 else [sum(map(len, requests))]
    for rank, r in enumerate(get_pool(tp).run(run, tp, dp, requests, policy)):
        d = r["dp_rank"]
        assert r["mode"] == policy and r["released"]
        first, step = sum(counts[:d]), sum(steps[:d])
        torch.testing.assert_close(r["prefill"], ref["prefill"][first:first + counts[d]],
                                   atol=1e-5, rtol=0, msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(r["decode"], ref["decode"][step:step + steps[d]],
                                   atol=1e-5, rtol=0, msg=lambda m: f"rank {rank}: {m}")
        # the FFN's entry completes the attention's partial onto this DP rank's own rows
        local = "attn_dp" if dp > 1 else "replicated"
        assert f"update+norm on {local}" in r["ffn_entry"], r["ffn_entry"]


def virtual(tp: int, dp: int, **kwargs) -> BoundaryRuntime:
    return BoundaryRuntime(virtual_parallel(ParallelDims(world_size=tp, tp=tp, attn_dp=dp)),
                           **kwargs)


@pytest.mark.parametrize("variants", [
    (BatchVariant.ORDINARY, BatchVariant.SEQUENCE_PARALLEL),
    (BatchVariant.ORDINARY, BatchVariant.INPUT_SCATTERED)], ids=["sequence-parallel",
                                                                 "input-scattered"])
def test_a_batch_variant_not_built_for_it_is_refused_at_construction(variants):
    rt = virtual(2, 1, boundary_reduction="rs", batch_variants=variants)
    with pytest.raises(UnsupportedBoundary, match="needs each request's tokens in order, and "
                                                  f"the {variants[1].value} batch variant"):
        build(rt)


def test_a_cp_batch_is_refused_at_construction():
    rt = BoundaryRuntime(virtual_parallel(ParallelDims(world_size=2, tp=2, attn_cp=2)),
                         batch_variants=(BatchVariant.CP,))
    with pytest.raises(UnsupportedBoundary, match="the CP batch variant is not built"):
        build(rt)


def test_a_convolution_given_other_rows_names_them():
    fb = ForwardBatch.build(ForwardMode.EXTEND, [[0] * 4], [0], kv_cache=cache(1))
    with pytest.raises(ValueError, match=f"got 2 rows; the batch holds 4 tokens "
                                         f"\\({SHORT_CONV_ROWS}\\)"):
        conv(1)(torch.zeros(2, HIDDEN), fb.kv_cache.short_conv["layer0.attn_sconv"], fb)


def test_sizes_and_a_state_of_another_kernel_or_width_are_refused_by_name():
    """Sizes at construction (a kernel of 0 ended in torch's negative-dimension error, a bool
    was a size), and the state where it is handed in: another kernel's or width's windows,
    or too few slots, ended in raw torch errors (prefill and decode alike), before anything
    is written. A kernel of 1 (config.json's least) keeps no window and runs."""
    for make, said in ((lambda: ShortConv(HIDDEN, 0), r"ShortConv\(kernel=0\): kernel must "
                        "be at least 1"),
                       (lambda: ShortConv(True, 2), r"ShortConv\(channels=True\): channels "
                        "must be an integer"),
                       (lambda: ShortConvState(1, {"k": HIDDEN}, 0), r"ShortConvState\("
                        "kernel=0\\)"),
                       (lambda: ShortConvState(1, {"k": 0}, 2), r"ShortConvState\("
                        r"channels\['k'\]=0\)")):
        with pytest.raises((TypeError, ValueError), match="^" + said):
            make()
    module = conv(1)
    expected = rf"it keeps fp32 \[slots, {KERNEL - 1}, {HIDDEN}\]"
    for kernel, width, slots, lens in ((KERNEL + 1, HIDDEN, 1, [3]), (KERNEL, HIDDEN + 1, 1, [3]),
                                       (KERNEL, HIDDEN, 1, [3, 2])):
        state = ShortConvState(slots, {"k": width}, kernel)
        before = state["k"].clone()
        for mode, prefixes in ((ForwardMode.EXTEND, [0] * len(lens)),
                               (ForwardMode.DECODE, [4] * len(lens))):
            ids = [[0] * n for n in lens] if mode is ForwardMode.EXTEND else [[0]] * len(lens)
            fb = ForwardBatch.build(mode, ids, prefixes, kv_cache=state)
            shape = rf"\[{slots}, {kernel - 1}, {width}\]"
            with pytest.raises(ValueError, match=rf"^ShortConv\(channels={HIDDEN}, kernel="
                                                 rf"{KERNEL}\) got a state {shape}; {expected}"):
                module(torch.zeros(fb.num_tokens, HIDDEN), state["k"], fb)
        assert torch.equal(state["k"], before)
    state = ShortConvState(1, {"k": HIDDEN}, KERNEL)
    with pytest.raises(ValueError, match="snapshot holds 'k' \\[1, 2, 8\\]; this state keeps "
                                         rf"\[1, {KERNEL - 1}, {HIDDEN}\]"):
        state.restore({"k": torch.zeros(1, 2, 8)})
    one = ShortConv(HIDDEN, 1)
    one.conv1d.weight.fill_(0.5)
    state = ShortConvState(1, {"k": HIDDEN}, 1)
    fb = ForwardBatch.build(ForwardMode.EXTEND, [[0] * 3], [0], kv_cache=state)
    x = seeded((3, HIDDEN), 4)
    assert torch.equal(one(x, state["k"], fb), x + 0.5 * x)


def test_without_its_forward_and_on_a_neighbour_it_never_runs():
    update = ShortConvUpdate.of(None, "mlp_sconv", 4)
    assert repr(update) == "ShortConvUpdate(layer4.mlp_sconv)"
    assert not update.plain and not update.portable and not update.at_producer
    assert update.reads_batch
    fb = ForwardBatch.build(ForwardMode.EXTEND, [[0] * 2], [0], kv_cache=cache(1))
    with pytest.raises(RuntimeError, match="layer4.mlp_sconv holds another rank's weights"):
        update.apply(torch.zeros(2, HIDDEN), torch.zeros(2, HIDDEN), fb)
    mine = ShortConvUpdate(conv(1), name="layer0.attn_sconv")
    with pytest.raises(RuntimeError, match="^layer0.attn_sconv: " + NO_FORWARD[:40]):
        mine.apply(torch.zeros(2, HIDDEN), torch.zeros(2, HIDDEN), None)


def test_a_snapshot_refuses_it_and_bf16_rounds_once():
    rt = runtime()
    layers, _ = build(rt)
    fb = ForwardBatch.build(ForwardMode.EXTEND, [[0] * 4], [0], kv_cache=cache(1))
    residual_batch.start(fb)
    h = layers[0](seeded((4, HIDDEN), 3), fb)
    with pytest.raises(RuntimeError, match=SNAPSHOT_NOT_PLAIN):
        residual_batch.snapshot(h, fb)
    residual, out = seeded((4, HIDDEN), 1).bfloat16(), seeded((4, HIDDEN), 2).bfloat16()
    update = ShortConvUpdate(layers[0].attn_sconv, name="layer0.attn_sconv")
    got = update.apply(residual, out, fb)
    conv_out = layers[0].attn_sconv(out, fb.kv_cache.short_conv["layer0.attn_sconv"], fb)
    assert got.dtype is torch.bfloat16 and conv_out.dtype is torch.bfloat16
    assert torch.equal(got, (residual.float() + conv_out.float()).bfloat16())
