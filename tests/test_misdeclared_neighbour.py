"""A consumer declared with the wrong producer, outside any layer stack, on real gloo ranks.

Built with ``make_attn_stage``/``make_ffn_stage`` outside a stack, nothing cross-checks the
neighbours' declarations, so what arrives at run time is the only truth: an attention whose
output carries an after-sum ``OutputTransform`` (or a custom update that is not a plain add),
and an FFN whose ``previous`` says a plain attention. The path the consumer bound for a plain
update may move the residual add before the sum (``ar`` under attention DP); applied to a
transformed or custom update that is a wrong number. Every row mode must either give the
numbers of a correctly declared stack or refuse by name before any collective, with the
ledger empty and the stream still holding the producer's output.
"""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, DpBatch, ToyAttn, ToyFfn, runtime, seeded, toy_norm

from layer_boundary import (OutputTransform, declare_attn, declare_ffn, make_attn_stage,
                            make_ffn_stage)
from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual.add_norm import PlainAdd
from layer_boundary.prepare import MISDECLARED_UPDATE
from layer_boundary.runtime.ledger import LEDGER


def _softcap(x):
    return 3.0 * torch.tanh(x / 3.0)


SOFTCAP = OutputTransform(_softcap, before_reduce_scatter=False)


class ScaledAdd(PlainAdd):
    """A custom update: ``residual + 0.5 * contribution`` (declares nothing of its parent)."""

    def apply(self, residual, contribution):
        return super().apply(residual, 0.5 * contribution)


def _attn(kind: str, **kwargs):
    if kind == "transform":
        return declare_attn(output_transform=SOFTCAP, **kwargs)
    return declare_attn(update=ScaledAdd(), **kwargs)


def run(tp: int, dp: int, policy: str, counts, kind: str, misdeclared: bool) -> dict:
    """attention (with ``kind``'s update) -> FFN, each built alone; the FFN's ``previous``
    is a plain attention where ``misdeclared``, else the real one."""
    rt = runtime(tp, dp, boundary_reduction=policy)
    par = rt.parallel
    attn = make_attn_stage(_attn(kind), toy_norm(10), runtime=rt, name="attn0")
    said = declare_attn() if misdeclared else _attn(kind)
    ffn = make_ffn_stage(declare_ffn(previous=said, terminal=True), toy_norm(20), runtime=rt,
                         name="ffn0")
    b = DpBatch(counts, rt)
    residual_batch.start(b.fb)
    h = b.mine(seeded((sum(counts), HIDDEN), 5))
    x = attn.prepare(h, b.fb)
    h = attn.finish(ToyAttn(par, 100)(x), b.fb)
    with LEDGER.recording() as entries:
        try:
            x = ffn.prepare(h, b.fb)
        except RuntimeError as exc:
            stream = b.fb.residual_stream
            return {"refused": str(exc), "ledger": len(entries),
                    "handle_kept": stream.handle is h and stream.contribution is not None}
    with ffn.exit(b.fb) as out:
        y = ToyFfn(par, 200)(x)
    h = out.finish(y)
    return {"out": residual_batch.norm(h, b.fb, toy_norm(99)),
            "rows": (b.rows.start, b.rows.stop)}


# every row mode, attention DP with an idle DP rank (ar under attention DP is where the
# misdeclared path added the residual before the sum)
CASES = [(1, 1, "ar", (6,)), (2, 1, "ar", (5,)), (4, 2, "ar", (5, 3)), (4, 2, "ar", (0, 5)),
         (4, 2, "rs", (0, 5)), (4, 2, "rsv", (5, 0))]
WRONG_BEFORE = [(4, 2, "ar", (5, 3)), (4, 2, "ar", (0, 5))]


@pytest.mark.parametrize("kind", ["transform", "custom"])
@pytest.mark.parametrize("tp,dp,policy,counts", CASES)
def test_a_misdeclared_plain_previous_is_refused_before_any_collective(kind, tp, dp, policy,
                                                                        counts):
    for r in get_pool(tp).run(run, tp, dp, policy, counts, kind, True):
        assert r.get("refused") == MISDECLARED_UPDATE.format(stage="ffn0"), r
        assert r["ledger"] == 0
        assert r["handle_kept"]


@pytest.mark.parametrize("kind", ["transform", "custom"])
@pytest.mark.parametrize("tp,dp,policy,counts", WRONG_BEFORE)
def test_the_correct_declaration_matches_world_1(kind, tp, dp, policy, counts):
    full = get_pool(1).run(run, 1, 1, "ar", (sum(counts),), kind, False)[0]["out"]
    for r in get_pool(tp).run(run, tp, dp, policy, counts, kind, False):
        assert "refused" not in r
        lo, hi = r["rows"]
        torch.testing.assert_close(r["out"], full[lo:hi], atol=1e-5, rtol=1e-5)
