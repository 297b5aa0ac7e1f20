"""residual.batch accessors on every row mode, against world 1.

Each scenario runs a three-layer toy stack and uses one accessor on a real pending output:
the attention's owed attn_tp sum or the FFN's deferred / reduce-scattered TP sum. What the
accessor returns (on this DP rank's local rows), the stream state it leaves and the stack's
final output must equal the world-1 run of the same tokens, under ar, rs and rsv, with
attention DP and a DP rank with no tokens.
"""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, DpBatch, ToyStack, cp_case_id, runtime, seeded

from layer_boundary.residual import batch as residual_batch

LAYERS = 3


def _after(stack, fb, x, where: str):
    """Run the stack up to ``where`` ("attn": layer 0's attention finish, "ffn": layer 0's
    FFN exit, "ffn1": layer 1's FFN exit); returns the pending handle."""
    layer0 = stack.layers[0]
    h = layer0.attn_half(x, fb)
    if where == "attn":
        return h
    h = layer0.ffn_half(h, fb)
    return stack.layers[1].forward_layer(h, fb) if where == "ffn1" else h


def _resume(stack, fb, h, where: str):
    """Finish the stack from where ``_after`` stopped; returns the final norm's output."""
    start = {"attn": 0, "ffn": 1, "ffn1": 2}[where]
    if where == "attn":
        h = stack.layers[0].ffn_half(h, fb)
        start = 1
    for layer in stack.layers[start:]:
        h = layer.forward_layer(h, fb)
    return stack.final(h, fb)


def scenario(stack, b: DpBatch, x, extra, name: str) -> dict:
    fb = b.fb
    residual_batch.start(fb)
    out = {}
    accessor, _, where = name.partition("@")
    if accessor == "written-entry":  # a residual the model wrote before any stage ran
        w = residual_batch.written(x * 1.5, fb)
        out["out"] = _resume(stack, fb, stack.layers[0].attn_half(w, fb), "attn")
        return out
    h = _after(stack, fb, x, where)
    if accessor == "complete_output":
        h = residual_batch.complete_output(h, fb)
        out["value"] = h.clone()
    elif accessor == "fold":
        h = residual_batch.fold(h, fb)
        out["value"] = h.clone()
    elif accessor == "snapshot":
        out["value"] = residual_batch.snapshot(h, fb)
    elif accessor == "add_to_output":
        h = residual_batch.add_to_output(h, fb, extra)
        out["value"] = h.clone()
    elif accessor == "written":  # compute that produced the full residual itself
        folded = residual_batch.fold(h, fb)
        h = residual_batch.written(folded * 1.5, fb)
    elif accessor == "take_output":  # fold -> the model's own norm -> written -> take_output
        folded = residual_batch.fold(h, fb)
        normed = residual_batch.written(stack.final_norm(folded), fb)
        out["value"] = residual_batch.take_output(normed, fb)
        out["released"] = fb.residual_stream is None
        return out
    out["state"] = fb.residual_stream.state.value
    out["out"] = _resume(stack, fb, h, where)
    return out


SCENARIOS = [f"{a}@{w}" for a in ("complete_output", "fold", "snapshot", "add_to_output",
                                  "written") for w in ("attn", "ffn", "ffn1")] + [
    "take_output@ffn1", "take_output@attn", "written-entry"]


def run_all(tp: int, dp: int, policy: str, counts: tuple[int, ...], cp: int = 1,
            lens=None) -> dict:
    rt = runtime(tp, dp, cp, boundary_reduction=policy)
    stack = ToyStack(rt, LAYERS)
    total = sum(counts)
    results, modes = {}, set()
    for name in SCENARIOS:
        b = DpBatch(counts, rt, lens)
        x = b.mine(seeded((total, HIDDEN), 1))
        extra = b.mine(seeded((total, HIDDEN), 2) * 0.5)
        results[name] = scenario(stack, b, x, extra, name)
        modes.add(b.fb.rows.mode.value)
    return {"results": results, "modes": modes, "rows": (b.rows.start, b.rows.stop)}


def check_against_world1(results: list[dict], counts: tuple[int, ...], policy: str) -> None:
    ref = run_all(1, 1, "ar", counts)["results"]
    for rank, r in enumerate(results):
        assert r["modes"] == {policy}, (rank, r["modes"])
        rows = slice(*r["rows"])
        for name, got in r["results"].items():
            want = ref[name]
            assert got.keys() == want.keys(), name
            for key, value in got.items():
                if isinstance(value, torch.Tensor):
                    torch.testing.assert_close(
                        value, want[key][rows], atol=1e-5, rtol=0,
                        msg=lambda m: f"rank {rank} {name} {key}: {m}")
                else:
                    assert value == want[key], (rank, name, key)


def test_world1_scenarios_differ_from_each_other():
    """Guards the comparison below: each accessor changes what the stack computes."""
    out = run_all(1, 1, "ar", (5,))["results"]
    finals = {name: r["out"] for name, r in out.items() if "out" in r}
    plain = finals["complete_output@ffn"]
    for name in ("add_to_output@ffn", "written@ffn", "written-entry"):
        assert (finals[name] - plain).abs().max() > 1e-3, name


# (tp, dp, policy, counts): every row mode, a remainder over attention TP (5 rows on 4
# ranks leaves one rank none in rs), attention DP, and a DP rank with no tokens
CASES = [(2, 1, "ar", (5,)), (2, 1, "rs", (5,)), (4, 1, "rs", (5,)),
         (4, 2, "ar", (5, 3)), (4, 2, "rs", (5, 3)), (4, 2, "rsv", (5, 3)),
         (4, 2, "ar", (5, 0)), (4, 2, "rs", (0, 5)), (4, 2, "rsv", (5, 0))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy,counts", CASES,
                         ids=[f"tp{t}-dp{d}-{p}-{'_'.join(map(str, c))}" for t, d, p, c in CASES])
def test_accessors_match_world1(tp, dp, policy, counts):
    check_against_world1(get_pool(tp).run(run_all, tp, dp, policy, counts), counts, policy)


# CP batches (each DP rank's requests): the accessors take and give local rows while the
# residual lives on CP shares; a request shorter than 2 x cp, a DP rank with none
CP_CASES = [(2, 1, 2, "ar", ((6, 3),)), (2, 1, 2, "rsv", ((6, 3),)), (4, 1, 2, "rs", ((7, 2),)),
            (4, 1, 4, "rsv", ((9,),)), (4, 2, 2, "ar", ((5,), (3,))),
            (4, 2, 2, "rsv", ((5, 2), ())), (4, 2, 2, "rs", ((), (3,)))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,cp,policy,lens", CP_CASES,
                         ids=[cp_case_id(*case) for case in CP_CASES])
def test_accessors_match_world1_in_a_cp_batch(tp, dp, cp, policy, lens):
    counts = tuple(map(sum, lens))
    check_against_world1(get_pool(tp).run(run_all, tp, dp, policy, counts, cp, lens), counts,
                         policy)
