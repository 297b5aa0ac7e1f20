"""``FusedMoE(dispatch=True)`` on real gloo ranks against the gathered MoE at world 1.

Every rank holds its own rows (attention DP = TP, as the all-to-all path runs); the routing is
drawn from one seed, so every rank knows all of it and can compute what each all-to-all must
move. Checked: the complete output per row, the ledger's all-to-all element counts (rows sent
to other ranks, their ids and weights, the combine's returns), identity experts, moe_tp > 1
(each EP rank's shards all get the token), a rank with no rows, and a router choice no rank
owns, refused on every rank before any row moves.
"""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool

from layer_boundary.models.moe import FusedMoE
from layer_boundary.runtime import LEDGER, ParallelDims, build_parallel, virtual_parallel

E, H, INTER, K = 8, 16, 8, 3


def _experts(parallel, dispatch: bool, zero: int) -> FusedMoE:
    moe = FusedMoE(E, H, INTER, parallel, zero_experts=zero, dispatch=dispatch)
    gen = torch.Generator().manual_seed(7)  # the same weights on every rank
    for e in range(E):
        for which, shape in (("gate", (INTER, H)), ("up", (INTER, H)), ("down", (H, INTER))):
            moe.weight_loader(None, torch.randn(shape, generator=gen) * 0.3, (e, which))
    return moe


def _routing(counts, zero: int):
    """Every rank's rows, expert ids (distinct per token) and weights, from one seed."""
    gen = torch.Generator().manual_seed(11)
    total = sum(counts)
    x = torch.randn(total, H, generator=gen)
    ids = torch.stack([torch.randperm(E + zero, generator=gen)[:K] for _ in range(total)])
    weights = torch.rand(total, K, generator=gen)
    return x, ids.reshape(total, K), weights


def _expected_elements(ids_all, counts, rank: int, ep: int, moe_tp: int) -> dict:
    """What this rank's all-to-alls move to other ranks: a row to each rank holding one of a
    token's experts (all moe_tp shards of that EP rank), its ids and weights with it, and the
    returns of the rows other ranks sent here."""
    local = E // ep
    starts = [sum(counts[:r]) for r in range(len(counts))]

    def sent(src: int, dst: int) -> int:
        ids = ids_all[starts[src]:starts[src] + counts[src]]
        return int(((ids < E) & (ids // local == dst // moe_tp)).any(dim=1).sum())

    others = [d for d in range(len(counts)) if d != rank]
    rows_out = sum(sent(rank, d) for d in others)
    rows_back = sum(sent(d, rank) for d in others)
    # counts: (rows, router flagged, the id it chose) to each other rank
    return {"counts": 3 * len(others), "rows": rows_out * H, "meta": rows_out * 2 * K,
            "combine": rows_back * H}


def dispatch_case(tp: int, ep: int, counts, zero: int = 0, bad_rank: int | None = None,
                  bad_id: int = E):
    par = build_parallel(ParallelDims(world_size=tp, tp=tp, attn_dp=tp, moe_ep=ep))
    rank = par.tp_group.rank
    x_all, ids_all, w_all = _routing(counts, zero)
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    x, ids, w = x_all[mine], ids_all[mine].clone(), w_all[mine]
    if bad_rank == rank and ids.numel():
        ids[0, 0] = bad_id  # no rank owns it
    moe = _experts(par, True, zero)
    try:
        with LEDGER.recording() as entries:
            out = moe(x, ids, w)
    except ValueError as exc:
        return {"error": str(exc)}
    ref = _experts(virtual_parallel(ParallelDims(world_size=1)), False, zero)(x, ids, w)
    moved = [e.numel for e in entries if e.kind == "all_to_all"]
    return {"out": out, "ref": ref, "moved": moved,
            "expected": _expected_elements(ids_all, counts, rank, ep, tp // ep)}


CASES = [(2, 2, (5, 4), 0), (4, 4, (3, 6, 2, 4), 0), (4, 2, (4, 3, 5, 2), 0),
         (4, 4, (3, 0, 5, 2), 0), (4, 4, (2, 3, 0, 4), 2)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tp,ep,counts,zero", CASES, ids=[
    f"tp{t}-ep{e}-{'_'.join(map(str, c))}{'-identity' if z else ''}" for t, e, c, z in CASES])
def test_dispatched_experts_match_the_gathered_ones(tp, ep, counts, zero):
    for rank, r in enumerate(get_pool(tp).run(dispatch_case, tp, ep, counts, zero)):
        assert r["out"].shape == (counts[rank], H)
        torch.testing.assert_close(r["out"], r["ref"], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"rank {rank}: {m}")
        want = r["expected"]
        # counts, dispatched rows, their ids and weights, the combine's returns
        assert r["moved"] == [want["counts"], want["rows"], want["meta"], want["combine"]], (
            rank, r["moved"], want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad_id", [E, -1])
def test_a_router_choice_no_rank_owns_is_refused_on_every_rank(bad_id):
    results = get_pool(4).run(dispatch_case, 4, 4, (3, 2, 4, 1), 0, 2, bad_id)
    assert [r.get("error") for r in results] == [
        f"the router on TP rank 2 chose expert {bad_id}, which no rank owns (experts "
        f"0..{E - 1})"] * 4


# ------------------------------------------------------------------ declaration misuse


@pytest.mark.parametrize("kwargs,message", [
    ({"dispatches": True}, "declare_ffn: dispatches=True is for a MoE"),
    ({"dispatches": True, "sparse": True,
      "reduction": __import__("layer_boundary").ProducerReduction.LOCAL_TAIL},
     "declare_ffn: a dispatching MoE returns its output complete")])
def test_a_dispatching_declaration_that_cannot_hold_is_refused(kwargs, message):
    from layer_boundary import declare_ffn

    with pytest.raises(ValueError, match=f"^{message}"):
        declare_ffn(**kwargs)


def test_a_dispatching_moe_needs_the_all_to_all_runtime():
    from toy import runtime, toy_norm

    from layer_boundary import declare_attn, declare_ffn, make_stages
    from layer_boundary.construction import UnsupportedBoundary

    with pytest.raises(UnsupportedBoundary, match=r"^stage layer0.ffn dispatches its routed "
                                                  r"tokens itself .* moe_a2a_backend is 'none'"):
        make_stages((declare_attn(), toy_norm(0)),
                    (declare_ffn(sparse=True, dispatches=True), toy_norm(1)),
                    runtime=runtime(), name="layer0", terminal=True)
    # on an all-to-all runtime it builds: input and output on the residual's rows
    _, ffn = make_stages((declare_attn(), toy_norm(0)),
                         (declare_ffn(sparse=True, dispatches=True), toy_norm(1)),
                         runtime=runtime(moe_a2a_backend="all_to_all"), name="layer0",
                         terminal=True)
    row = ffn.plan.describe()
    assert row["compute"] == row["residual"]
    assert row["exit"] == "complete: all_to_all(tp) dispatch and combine in compute"
