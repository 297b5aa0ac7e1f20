"""Auxiliary capture and extra contributions on every row mode, against world 1.

Entry points: attention ``prepare(capture_output=...)`` (the stack input at entry, then the
updated residual back on local rows), ``prepare(captured_last_layer_outputs=...)`` (the
updated residual on the attention's compute-input rows), ``prepare(post_residual_addition=...)``
(with and without a capture, which then sees output plus residual before the addition),
``boundary.capture_output()`` (a static sum snapshotted on a copy and left owed, a dynamic one
completed on the main output) and ``norm(capture_output=...)`` (always borrowed). Values are
compared with the world-1 run of the same tokens; ``owned`` is checked against what the
boundary may promise: fresh storage only where a gather or a sum allocated it.
"""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, DpBatch, ToyStack, batch, cp_case_id, runtime, seeded

from layer_boundary.fusions.reference import ReferenceFusions
from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual.stream import StreamState

LAYERS = 3


class Collector:
    """Keeps what it is given; copies borrowed values (as AuxHiddenStateList does)."""

    def __init__(self) -> None:
        self.values, self.owned = [], []

    def capture(self, value, *, owned=False):
        self.values.append(value if owned else value.clone())
        self.owned.append(owned)


def scenario(stack, b: DpBatch, x, extras, name: str) -> dict:
    fb = b.fb
    residual_batch.start(fb)
    layers = stack.layers
    out: dict = {}
    if name == "capture_output":
        c = Collector()
        h = x
        for layer in layers:
            h = layer.ffn_half(layer.attn_half(h, fb, capture_output=c.capture), fb)
        out["out"] = stack.final(h, fb, capture_output=c.capture)
        out["values"], out["owned"] = c.values, c.owned
    elif name == "captured_last_layer_outputs":
        c, plain = Collector(), []
        h = x
        for i, layer in enumerate(layers):
            # a collector with capture(), and a plain list (which keeps copies)
            h = layer.ffn_half(layer.attn_half(
                h, fb, captured_last_layer_outputs=c if i % 2 else plain), fb)
        out["out"] = stack.final(h, fb)
        out["values"], out["owned"], out["list"] = c.values, c.owned, plain
    elif name in ("post_residual_addition", "post_residual_addition+capture"):
        c = Collector()
        capture = c.capture if name.endswith("capture") else None
        h = x
        for i, layer in enumerate(layers):  # deepstack-style extras into every layer
            h = layer.ffn_half(layer.attn_half(h, fb, capture_output=capture,
                                               post_residual_addition=extras[i]), fb)
        out["out"] = stack.final(h, fb)
        out["values"], out["owned"] = c.values, c.owned
    elif name == "boundary.capture_output":
        layer0, layer1 = layers[0], layers[1]
        h = layer0.attn_half(x, fb)
        h, static = layer0.attn.capture_output(h, fb)  # a declared sum: snapshot on a copy
        out["static_still_owed"] = fb.residual_stream.contribution.owed is not None
        h = layer0.ffn_half(h, fb)
        h, dynamic = layer1.attn.capture_output(h, fb)  # exit-decided work: completed on main
        out["dynamic_completed"] = fb.residual_stream.contribution.owed is None
        out["state"] = fb.residual_stream.state.value
        h = layer1.ffn_half(layer1.attn_half(h, fb), fb)
        out["out"] = stack.final(layers[2].forward_layer(h, fb), fb)
        out["values"] = [static, dynamic]
    return out


SCENARIOS = ["capture_output", "captured_last_layer_outputs", "post_residual_addition",
             "post_residual_addition+capture", "boundary.capture_output"]


def run_all(tp: int, dp: int, policy: str, counts: tuple[int, ...], cp: int = 1,
            lens=None) -> dict:
    rt = runtime(tp, dp, cp, boundary_reduction=policy)
    stack = ToyStack(rt, LAYERS)
    total = sum(counts)
    results = {}
    for name in SCENARIOS:
        b = DpBatch(counts, rt, lens)
        x = b.mine(seeded((total, HIDDEN), 3))
        extras = [b.mine(seeded((total, HIDDEN), 10 + i) * 0.3) for i in range(LAYERS)]
        results[name] = scenario(stack, b, x, extras, name)
    attn_tp = b.fb.rows.attn_tp
    return {"results": results, "rows": (b.rows.start, b.rows.stop), "attn_tp": attn_tp,
            "share": b.share, "gathers": attn_tp > 1 and policy != "ar", "cp": cp > 1}


def expected_owned(name: str, gathers: bool, cp: bool = False) -> list[bool] | None:
    """What ``owned`` each capture may carry: the entry input and the final norm's residual
    are borrowed; a residual brought back through a gather (over attention TP from scattered
    rows, over CP from a CP share to local rows), or a sum computed for the capture, is
    fresh."""
    to_local = gathers or cp
    return {
        "capture_output": [False, to_local, to_local, False],
        "captured_last_layer_outputs": [gathers],  # the collector sees layer 1 only
        "post_residual_addition": [],
        "post_residual_addition+capture": [False, True, True],
    }.get(name)


def _close(got, want, what):
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m: f"{what}: {m}")


def check(results: list[dict], counts) -> None:
    ref = run_all(1, 1, "ar", counts)["results"]
    for rank, r in enumerate(results):
        rows = slice(*r["rows"])
        # the attention's compute-input rows: the DP rank's, or in a CP batch its CP share
        attention = rows if r["share"] is None else r["share"]
        for name, got in r["results"].items():
            want = ref[name]
            at = attention if name == "captured_last_layer_outputs" else rows
            _close(got["out"], want["out"][rows], f"rank {rank} {name} out")
            assert len(got["values"]) == len(want["values"]), (rank, name)
            for i, (g, w) in enumerate(zip(got["values"], want["values"])):
                _close(g, w[at], f"rank {rank} {name} capture {i}")
            for i, (g, w) in enumerate(zip(got.get("list", []), want.get("list", []))):
                _close(g, w[at], f"rank {rank} {name} list capture {i}")
            owned = expected_owned(name, r["gathers"], r.get("cp", False))
            if owned is not None:
                assert got["owned"] == owned, (rank, name, got["owned"])
            if name == "boundary.capture_output":
                # the attention's declared sum stays owed (where there is one to owe); the
                # FFN's exit-decided one was completed on the main output
                assert got["static_still_owed"] == (r["attn_tp"] > 1), rank
                assert got["dynamic_completed"] and got["state"] == "pending", rank


def test_world1_captures_see_what_they_promise():
    r = run_all(1, 1, "ar", (5,))["results"]
    cap = r["capture_output"]
    assert len(cap["values"]) == LAYERS + 1  # the entry input, two updated residuals, final
    torch.testing.assert_close(cap["values"][0], seeded((5, HIDDEN), 3))
    # the layer-1 capture (updated residual) equals what captured_last_layer_outputs sees
    torch.testing.assert_close(cap["values"][1], r["captured_last_layer_outputs"]["values"][0])
    # the extra addition changes the result; the capture precedes it
    assert (r["post_residual_addition"]["out"] - cap["out"]).abs().max() > 1e-3
    torch.testing.assert_close(r["post_residual_addition"]["out"],
                               r["post_residual_addition+capture"]["out"])
    # one rank owes nothing; the update stays pending after the capture
    b = r["boundary.capture_output"]
    assert not b["static_still_owed"] and b["dynamic_completed"]
    assert b["state"] == StreamState.PENDING.value


CASES = [(2, 1, "ar", (5,)), (2, 1, "rs", (5,)), (4, 1, "rs", (5,)),
         (4, 2, "ar", (5, 3)), (4, 2, "rs", (5, 3)), (4, 2, "rsv", (5, 3)),
         (4, 2, "rs", (5, 0)), (4, 2, "rsv", (0, 5))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy,counts", CASES,
                         ids=[f"tp{t}-dp{d}-{p}-{'_'.join(map(str, c))}" for t, d, p, c in CASES])
def test_captures_match_world1(tp, dp, policy, counts):
    check(get_pool(tp).run(run_all, tp, dp, policy, counts), counts)


# CP batches: each DP rank's requests (one shorter than 2 x cp; an empty DP rank)
CP_CASES = [(2, 1, 2, "ar", ((7, 2),)), (2, 1, 2, "rsv", ((7, 2),)), (4, 1, 2, "rs", ((9, 3),)),
            (4, 1, 4, "rsv", ((10,),)), (4, 2, 2, "ar", ((5, 3), (2,))),
            (4, 2, 2, "rsv", ((5, 3), ())), (4, 2, 2, "rs", ((), (3,)))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,cp,policy,lens", CP_CASES,
                         ids=[cp_case_id(*case) for case in CP_CASES])
def test_captures_match_world1_in_a_cp_batch(tp, dp, cp, policy, lens):
    counts = tuple(map(sum, lens))
    check(get_pool(tp).run(run_all, tp, dp, policy, counts, cp, lens), counts)


def provider_accepts(capture: bool) -> int:
    """Fused inputs a provider completed on a tp=2 ar stack, with and without captures."""
    fusions = ReferenceFusions()
    stack = ToyStack(runtime(2), LAYERS, fusions=fusions)
    fb = batch(5)
    residual_batch.start(fb)
    h = seeded((5, HIDDEN), 3)
    kwargs = {"capture_output": Collector().capture} if capture else {}
    for layer in stack.layers:
        h = layer.ffn_half(layer.attn_half(h, fb, **kwargs), fb)
    stack.final(h, fb)
    return fusions.accepted


@pytest.mark.timeout(60)
def test_capture_completes_unfused():
    # the deferred FFN sums of layers 0 and 1 reach a fused candidate unless a capture asks
    # for the unfused completion (the add+norm read still runs)
    assert get_pool(2).run(provider_accepts, False) == [2, 2]
    assert get_pool(2).run(provider_accepts, True) == [0, 0]


def test_ffn_prepare_does_not_take_captures():
    stack, fb = ToyStack(runtime(), 1), batch()
    residual_batch.start(fb)
    h = stack.layers[0].attn_half(torch.ones(3, HIDDEN), fb)
    for name in ("capture_output", "captured_last_layer_outputs", "post_residual_addition"):
        with pytest.raises(TypeError, match=f"^FFN prepare\\(\\) does not accept {name}$"):
            stack.layers[0].ffn.prepare(h, fb, **{name: []})
