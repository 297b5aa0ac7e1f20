"""``can_defer_finalize`` on the three FFN exits that complete their output in other ways: a
MoE that dispatches its tokens itself (all-to-all), a sequence-parallel FFN (its row-parallel
linear reduce-scatters), and an FFN whose ``OutputTransform`` runs before the sum. The spec
asks the question on every FFN exit that has a provider; a yes publishes
``defer_moe_finalize`` and compute may return a ``HandoffOutput`` there: handed on complete
(dispatch, sequence-parallel), or owing its sum with the transform carried into its
completion. Either answer gives world-1 numbers on every row mode, an empty DP rank included;
a terminal service never sums a handoff that owes nothing."""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from test_sequence_parallel import LinearPair
from toy import HIDDEN, DpBatch, ToyAttn, ToyFfn, ToyHandoff, runtime, seeded, toy_norm

from layer_boundary import OutputTransform, declare_attn, declare_ffn, make_stages
from layer_boundary.fusions.reference import ReferenceFusions
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime import BatchVariant, get_forward
from layer_boundary.runtime.norm import GemmaRMSNorm

LAYERS = 3
KINDS = ("dispatch", "sp", "transform")


class Answering(ReferenceFusions):
    """The reference provider answering ``can_defer_finalize`` with ``answer``, recording each
    question as (stage, question)."""

    def __init__(self, answer: bool) -> None:
        super().__init__(terminal_finalize=True)
        self.answer, self.asked = answer, []

    def can_defer_finalize(self, plan, forward_batch) -> bool:
        self.asked.append((plan.stage, "finalize"))
        return self.answer

    def can_defer_all_reduce(self, plan, forward_batch) -> bool:
        self.asked.append((plan.stage, "all_reduce"))
        return False


class Dispatched:
    """A MoE stand-in that reaches its experts itself: tanh(x) @ W with the whole W, complete
    on the rows it is given (the residual's), as a dispatching MoE's combine leaves them."""

    def __init__(self, seed: int) -> None:
        self.w = seeded((HIDDEN, HIDDEN), seed) * 0.4

    def __call__(self, x):
        return torch.tanh(x) @ self.w


def half(x):
    return 0.5 * x


def declare(kind: str):
    if kind == "dispatch":
        return declare_ffn(sparse=True, next_sparse=True, dispatches=True)
    if kind == "sp":
        return declare_ffn(sequence_parallel=True)
    return declare_ffn(output_transform=OutputTransform(half, before_reduce_scatter=True))


def run(tp: int, dp: int, policy: str, counts, kind: str, answer: bool | None) -> dict:
    variants = (BatchVariant.ORDINARY,) + (
        (BatchVariant.SEQUENCE_PARALLEL,) if kind == "sp" else ())
    rt = runtime(tp, dp, boundary_reduction=policy, batch_variants=variants,
                 moe_a2a_backend="all_to_all" if kind == "dispatch" else "none")
    par = rt.parallel
    fusions = None if answer is None else Answering(answer)
    options = {} if fusions is None else {"fusions": fusions}
    pairs = []
    for i in range(LAYERS):
        pairs += [(declare_attn(), toy_norm(10 + i), options),
                  (declare(kind), toy_norm(20 + i), options)]
    stages = make_stages(*pairs, terminal=True, runtime=rt, name="s")
    b = DpBatch(counts, rt)
    fb = b.fb
    if kind == "sp" and tp > 1:
        fb.variant = BatchVariant.SEQUENCE_PARALLEL
    residual_batch.start(fb)
    h = b.mine(seeded((sum(counts), HIDDEN), 7))
    deferred = []
    for i in range(LAYERS):
        attn, ffn = stages[2 * i], stages[2 * i + 1]
        h = attn.finish(ToyAttn(par, 30 + i)(attn.prepare(h, fb)), fb)
        x = ffn.prepare(h, fb)
        with ffn.exit(fb) as scope:
            compute = (Dispatched(40 + i) if kind == "dispatch" else
                       LinearPair(par.tp_group, 40 + i, True) if kind == "sp" else
                       ToyFfn(par, 40 + i))
            y = compute(x)
            defer = get_forward().defer_moe_finalize
            deferred.append(defer)
            if defer:  # compute's own choice: hand the finalize on (completing doubles it)
                y = ToyHandoff(y * 0.5)
        h = scope.finish(y)
    service = None if fusions is None else fusions.handoff_norm(1e-5)
    final = GemmaRMSNorm(HIDDEN, eps=1e-5)
    with torch.no_grad():
        final.weight.copy_(torch.linspace(-0.5, 0.5, HIDDEN))
    out = residual_batch.norm(h, fb, final, handoff_norm=service)
    return {"out": out, "rows": (b.rows.start, b.rows.stop), "mode": fb.rows.mode.value,
            "deferred": deferred, "asked": None if fusions is None else fusions.asked,
            "ffns": [stage.name for stage in stages[1::2]],
            "service_calls": None if service is None else service.calls}


CASES = [(2, 1, "ar", (4,)), (2, 1, "rs", (5,)), (2, 2, "ar", (3, 0)), (4, 2, "ar", (5, 3)),
         (4, 2, "rsv", (5, 0))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tp,dp,policy,counts", CASES,
                         ids=[f"tp{t}-dp{d}-{p}-{'_'.join(map(str, c))}" for t, d, p, c in CASES])
def test_every_ffn_exit_is_asked_and_either_answer_holds(tp, dp, policy, counts, kind):
    if kind == "sp" and policy == "ar":
        pytest.skip("a sequence-parallel batch runs in rs/rsv (its residual is scattered)")
    if kind == "dispatch" and policy == "ar" and dp != tp:
        pytest.skip("an all-to-all MoE under attention TP needs the scattered rows (rs/rsv)")
    ref = run(1, 1, "ar", counts, kind, None)["out"]
    for answer in (True, False):
        for rank, r in enumerate(get_pool(tp).run(run, tp, dp, policy, counts, kind, answer)):
            assert r["mode"] == policy
            assert r["asked"] == [(name, "finalize") for name in r["ffns"]], rank
            assert r["deferred"] == [answer] * LAYERS
            # the handoff owes a sum only after a before-sum transform: the TP-wide service
            # takes that one (where the residual and the handoff are on the same rows: ar,
            # every token this DP rank's), never one the dispatch or the linears completed
            start, stop = r["rows"]
            assert r["service_calls"] == (answer and kind == "transform" and policy == "ar"
                                          and stop - start == sum(counts))
            torch.testing.assert_close(r["out"], ref[slice(*r["rows"])], atol=1e-5, rtol=0,
                                       msg=lambda m: f"rank {rank} answer {answer}: {m}")
