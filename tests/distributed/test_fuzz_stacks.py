"""Fuzz: random stacks of 2-6 stages (PARTIAL attentions, SCOPED mixers, SCOPED dense and
sparse FFNs, LOCAL_TAIL FFNs, in any order), random topologies (tp 1/2/4, attention DP
dividing tp; CP batches on attention-CP topologies), random DP token counts (zeros included)
and every policy. Each example either
matches world 1 on real gloo ranks or is rejected at construction, identically on world 1.

``LB_FUZZ_EXAMPLES`` sets the number of examples (CI runs a few; a manual run more)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from toy import HIDDEN, DpBatch, ToyAttn, ToyFfn, runtime, seeded, toy_norm

from layer_boundary import ProducerReduction, declare_attn, declare_ffn, make_stages
from layer_boundary.construction import UnsupportedBoundary
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime import RowParallelLinear, all_reduce_rows, get_forward

from .pool import get_pool

EXAMPLES = int(os.environ.get("LB_FUZZ_EXAMPLES", "25"))
KINDS = ("attn", "mixer", "ffn", "ffn_sparse", "ffn_tail")
TAIL = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(11)) * 0.3


def declaration(kind: str):
    if kind == "attn":
        return declare_attn()
    if kind == "mixer":
        return declare_attn(reduction=ProducerReduction.SCOPED)
    if kind == "ffn_tail":
        return declare_ffn(reduction=ProducerReduction.LOCAL_TAIL)
    return declare_ffn(sparse=kind == "ffn_sparse")


class Mixer:
    """A single-stage mixer: a row-parallel projection over attention TP that honours the
    exit's flags (its sum left to the boundary when they say so)."""

    def __init__(self, par, seed):
        self.down = RowParallelLinear(2 * HIDDEN, HIDDEN, par.attn_tp_group)
        full = torch.randn(HIDDEN, 2 * HIDDEN, generator=torch.Generator().manual_seed(seed))
        self.down.weight_loader(self.down.weight, 0.3 * full)

    def __call__(self, x):
        k = self.down.in_per_rank
        xs = torch.tanh(x).repeat(1, 2)[:, self.down.group.rank * k:(self.down.group.rank + 1) * k]
        return self.down(xs)


class TailFfn(ToyFfn):
    """LOCAL_TAIL: the routed part's sum, then a replicated tail; when the exit defers the
    sum, exactly one rank carries the tail into it."""

    def __init__(self, par, seed):
        super().__init__(par, seed)
        self.down.reduce_results = False

    def __call__(self, x):
        partial = super().__call__(x)
        tail = torch.tanh(x) @ TAIL
        if not get_forward().skips_reduction:
            return all_reduce_rows(partial, self.down.group) + tail
        return partial + tail if self.down.group.rank == 0 else partial


def run(kinds, tp: int, dp: int, policy: str, counts, cp: int = 1, lens=None):
    """The stack on this rank: its output rows, or the construction-time rejection (with
    ``cp`` > 1, a CP batch of requests ``lens``)."""
    rt = runtime(tp, dp, cp, boundary_reduction=policy)
    par = rt.parallel
    norms = [toy_norm(50 + i) for i in range(len(kinds))]
    try:
        stages = make_stages(*((declaration(k), n) for k, n in zip(kinds, norms)),
                             terminal=True, runtime=rt, name="s")
    except UnsupportedBoundary as exc:
        return {"rejected": str(exc)}
    compute = [ToyAttn(par, 100 + i) if k == "attn" else Mixer(par, 100 + i) if k == "mixer"
               else TailFfn(par, 100 + i) if k == "ffn_tail" else ToyFfn(par, 100 + i)
               for i, k in enumerate(kinds)]
    b = DpBatch(counts, rt, lens)
    residual_batch.start(b.fb)
    h = b.mine(seeded((sum(counts), HIDDEN), 8))
    for kind, stage, fn in zip(kinds, stages, compute):
        x = stage.prepare(h, b.fb)
        if kind == "attn":
            h = stage.finish(fn(x), b.fb)
        else:
            with stage.exit(b.fb) as out:
                y = fn(x)
            h = out.finish(y)
    out = residual_batch.norm(h, b.fb, toy_norm(99))
    return {"out": out, "rows": (b.rows.start, b.rows.stop),
            "released": b.fb.residual_stream is None}


def assert_matches_or_rejected(case, ref: dict, results: list[dict]) -> None:
    """Every rank matches world 1's rows, or every rank was rejected as world 1 was."""
    if "rejected" in ref:
        assert all("rejected" in r for r in results), (case, ref["rejected"])
        return
    for rank, r in enumerate(results):
        assert "rejected" not in r, (case, r.get("rejected"))
        assert r["released"]
        torch.testing.assert_close(r["out"], ref["out"][slice(*r["rows"])], atol=1e-5, rtol=0,
                                   msg=lambda m: f"{case} rank {rank}: {m}")


TOPOLOGIES = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]


@st.composite
def cases(draw):
    kinds = tuple(draw(st.lists(st.sampled_from(KINDS), min_size=2, max_size=6)))
    tp, dp = draw(st.sampled_from(TOPOLOGIES))
    policy = draw(st.sampled_from(["ar", "rs", "rsv", "rs+rsv"]))
    counts = tuple(draw(st.lists(st.integers(0, 5), min_size=dp, max_size=dp)
                        .filter(lambda c: sum(c) > 0)))
    return kinds, tp, dp, policy, counts


@pytest.mark.timeout(600)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_random_stacks_match_world1_or_are_rejected_at_construction(case):
    kinds, tp, dp, policy, counts = case
    ref = run(kinds, 1, 1, "ar", counts)
    results = get_pool(tp).run(run, kinds, tp, dp, policy, counts)
    assert_matches_or_rejected(case, ref, results)


CP_TOPOLOGIES = [(2, 1, 2), (4, 1, 2), (4, 2, 2), (4, 1, 4)]


@st.composite
def cp_cases(draw):
    kinds = tuple(draw(st.lists(st.sampled_from(KINDS), min_size=2, max_size=5)))
    tp, dp, cp = draw(st.sampled_from(CP_TOPOLOGIES))
    policy = draw(st.sampled_from(["ar", "rs", "rsv", "rs+rsv"]))
    # every DP rank's requests: short ones (fewer tokens than 2 x cp) and none at all
    lens = tuple(tuple(draw(st.lists(st.integers(1, 9), max_size=3))) for _ in range(dp))
    assume(sum(map(sum, lens)) > 0)
    return kinds, tp, dp, cp, policy, lens


@pytest.mark.timeout(600)
@settings(max_examples=max(EXAMPLES // 2, 1), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cp_cases())
def test_random_cp_stacks_match_world1(case):
    """The same stacks in a CP batch: every stage kind on CP shares (the residual, norms and
    FFN rows on each rank's share of its DP rank's tokens), output back on local rows."""
    kinds, tp, dp, cp, policy, lens = case
    counts = tuple(map(sum, lens))
    ref = run(kinds, 1, 1, "ar", counts)
    results = get_pool(tp).run(run, kinds, tp, dp, policy, counts, cp, lens)
    assert_matches_or_rejected(case, ref, results)
