"""A fusion provider is asked where the spec says: ``can_defer_finalize`` on every FFN exit
that has a provider (dense or sparse), ``can_defer_all_reduce`` on a LOCAL_TAIL FFN (dense or
sparse) whose sum is one all-reduce over TP, after the finalize question was answered no.
What the answers select gives world-1 numbers on every row mode."""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from test_local_tail import tail_ffn
from toy import HIDDEN, DpBatch, ToyStack, runtime, seeded

from layer_boundary import ProducerReduction
from layer_boundary.fusions.reference import ReferenceFusions
from layer_boundary.residual import batch as residual_batch

LAYERS = 3


class Asked(ReferenceFusions):
    """The reference provider, recording each question as (stage, question)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.asked = []

    def can_defer_finalize(self, plan, forward_batch) -> bool:
        self.asked.append((plan.stage, "finalize"))
        return super().can_defer_finalize(plan, forward_batch)

    def can_defer_all_reduce(self, plan, forward_batch) -> bool:
        self.asked.append((plan.stage, "all_reduce"))
        return super().can_defer_all_reduce(plan, forward_batch)


def run(tp: int, dp: int, policy: str, counts, ffn: str, provider: dict | None) -> dict:
    rt = runtime(tp, dp, boundary_reduction=policy)
    fusions = None if provider is None else Asked(**provider)
    tail = ffn.endswith("tail")
    kwargs = {"ffn_sparse": ffn.startswith("sparse")}
    if tail:
        kwargs["ffn_reduction"] = ProducerReduction.LOCAL_TAIL
    stack = ToyStack(rt, LAYERS, fusions=fusions, **kwargs)
    if tail:
        for layer in stack.layers:
            layer.down.reduce_results = False  # tail_ffn owns its sum
    b = DpBatch(counts, rt)
    fb = b.fb
    residual_batch.start(fb)
    h = b.mine(seeded((sum(counts), HIDDEN), 3))
    skipped = []
    for layer in stack.layers:
        h = layer.attn_half(h, fb)
        h = layer.ffn.prepare(h, fb)
        with layer.ffn.exit(fb) as scope:
            y = tail_ffn(layer, h, scope) if tail else layer.ffn_compute(h)
        skipped.append(scope.skips_reduction)
        h = scope.finish(y)
    return {"out": stack.final(h, fb), "rows": (b.rows.start, b.rows.stop),
            "mode": fb.rows.mode.value, "skipped": skipped,
            "asked": None if fusions is None else fusions.asked}


def expected_questions(ffn: str, mode: str, tp: int) -> list:
    out = []
    for i in range(LAYERS):
        out.append((f"layer{i}.ffn", "finalize"))
        # the all-reduce question: LOCAL_TAIL, a consumer that can finish the sum (not the
        # last FFN), the all-reduce path, a sum at all; asked where finalize was declined
        finalize_yes = ffn.startswith("sparse") and i < LAYERS - 1
        if (ffn.endswith("tail") and i < LAYERS - 1 and mode == "ar" and tp > 1
                and not finalize_yes):
            out.append((f"layer{i}.ffn", "all_reduce"))
    return out


CASES = [(1, 1, "ar", (4,)), (2, 1, "ar", (4,)), (2, 1, "rs", (4,)), (4, 2, "ar", (5, 3)),
         (4, 2, "rsv", (5, 0)), (4, 2, "rs", (0, 5))]
FFNS = ["dense", "dense-tail", "sparse", "sparse-tail"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ffn", FFNS)
@pytest.mark.parametrize("tp,dp,policy,counts", CASES,
                         ids=[f"tp{t}-dp{d}-{p}-{'_'.join(map(str, c))}" for t, d, p, c in CASES])
def test_questions_are_asked_where_the_spec_says(tp, dp, policy, counts, ffn):
    ref = run(1, 1, "ar", counts, ffn, None)["out"]
    for provider in ({"defer_all_reduce": True}, {"defer_all_reduce": True,
                                                  "defer_finalize": False}):
        args = (tp, dp, policy, counts, ffn, provider)
        results = get_pool(tp).run(run, *args) if tp > 1 else [run(*args)]
        for rank, r in enumerate(results):
            assert r["mode"] == policy
            finalize = provider.get("defer_finalize", True)
            want = expected_questions(ffn if finalize else ffn.replace("sparse", "dense"),
                                      policy, tp)
            assert r["asked"] == want, (rank, provider)
            torch.testing.assert_close(r["out"], ref[slice(*r["rows"])], atol=1e-5, rtol=0,
                                       msg=lambda m: f"rank {rank} {provider}: {m}")


@pytest.mark.timeout(60)
def test_a_sparse_local_tail_defers_its_all_reduce_when_the_provider_lets_it():
    """The finalize question declined, the all-reduce one accepted: a non-terminal sparse
    LOCAL_TAIL FFN skips its sum (compute adds its tail on one rank) and numbers hold."""
    provider = {"defer_all_reduce": True, "defer_finalize": False}
    ref = run(1, 1, "ar", (5, 3), "sparse-tail", None)["out"]
    for r in get_pool(4).run(run, 4, 2, "ar", (5, 3), "sparse-tail", provider):
        assert r["skipped"] == [True, True, False]
        torch.testing.assert_close(r["out"], ref[slice(*r["rows"])], atol=1e-5, rtol=0)
