"""The sequence-parallel batch variant on a toy stack, against world 1 on real gloo ranks.

Each stage's compute is a column-parallel linear, tanh, and a row-parallel linear (the
attention's over attention TP, the FFN's over TP), declared ``sequence_parallel``: in a
sequence-parallel batch it runs on the scattered rows inside its exit scope, the column
linear all-gathers, the row linear reduce-scatters, and the boundary owes nothing after it.
A stage that does not declare it (``plain``: a hand-written FFN without column linears) runs
its rs/rsv path in the same batch. The ledger must show each movement where the scope ran it.
"""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, DpBatch, ToyFfn, runtime, seeded, toy_norm

from layer_boundary import declare_attn, declare_ffn, make_stages
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime import (LEDGER, BatchVariant, ColumnParallelLinear,
                                    RowParallelLinear)

SP = BatchVariant.SEQUENCE_PARALLEL


class LinearPair:
    """x -> row(tanh(column(x))) over ``group``: the same function at every size."""

    def __init__(self, group, seed: int, reduce_results: bool) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.up = ColumnParallelLinear(HIDDEN, 2 * HIDDEN, group)
        self.down = RowParallelLinear(2 * HIDDEN, HIDDEN, group, reduce_results=reduce_results)
        self.up.weight_loader(self.up.weight, torch.randn(2 * HIDDEN, HIDDEN, generator=gen) * .4)
        self.down.weight_loader(self.down.weight,
                                torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) * .4)

    def __call__(self, x):
        return self.down(torch.tanh(self.up(x)))


# a layer: "attn" (PARTIAL, sequence-parallel), "ffn" (sequence-parallel), "plain" (an FFN
# that is not: the boundary gathers its input and takes its sum)
KINDS = ("attn", "ffn", "attn", "plain", "attn", "ffn")


def run(tp: int, dp: int, policy: str, counts, variant: str = "sequence-parallel") -> dict:
    rt = runtime(tp, dp, boundary_reduction=policy,
                 batch_variants=(BatchVariant.ORDINARY, SP))
    par = rt.parallel
    decls = [declare_attn(sequence_parallel=True) if k == "attn"
             else declare_ffn(sequence_parallel=k == "ffn") for k in KINDS]
    stages = make_stages(*((d, toy_norm(10 + i)) for i, d in enumerate(decls)), terminal=True,
                         runtime=rt, name="s")
    compute = [LinearPair(par.attn_tp_group, 100 + i, False) if k == "attn"
               else LinearPair(par.tp_group, 100 + i, True) if k == "ffn" else ToyFfn(par, 100 + i)
               for i, k in enumerate(KINDS)]
    b = DpBatch(counts, rt)
    b.fb.variant = BatchVariant(variant)
    residual_batch.start(b.fb)
    h = b.mine(seeded((sum(counts), HIDDEN), 5))
    rows = []
    with LEDGER.recording() as ledger:
        for stage, fn in zip(stages, compute):
            x = stage.prepare(h, b.fb)
            rows.append(x.shape[0])
            with stage.exit(b.fb) as out:
                y = fn(x)
            h = out.finish(y)
        out = residual_batch.norm(h, b.fb, toy_norm(99))
    facts = b.fb.rows
    return {"out": out, "rows": (b.rows.start, b.rows.stop), "compute_rows": rows,
            "names": [stage.name for stage in stages],
            "scattered": facts.scattered, "local": facts.local, "total": facts.total,
            "mode": facts.mode.value, "released": b.fb.residual_stream is None,
            "ledger": [(e.site, e.kind, e.group, e.numel) for e in ledger]}


# (tp, dp, policy, DP token counts): rs pads (5 rows over attn_tp 2 or 4), rsv real rows,
# attention DP with an empty DP rank, attention TP 1 (dp = tp)
CASES = [(2, 1, "rs", (5,)), (2, 1, "rsv", (5,)), (4, 1, "rs", (5,)), (4, 1, "rsv", (7,)),
         (4, 2, "rsv", (5, 3)), (4, 2, "rs", (5, 3)), (4, 2, "rsv", (0, 5)),
         (4, 4, "rsv", (2, 0, 3, 1))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy,counts", CASES,
                         ids=[f"tp{t}-dp{d}-{p}-{'_'.join(map(str, c))}" for t, d, p, c in CASES])
def test_sequence_parallel_stack_matches_world1(tp, dp, policy, counts):
    ref = run(1, 1, "ar", counts, "ordinary")
    for rank, r in enumerate(get_pool(tp).run(run, tp, dp, policy, counts)):
        assert r["released"] and r["mode"] == policy
        torch.testing.assert_close(r["out"], ref["out"][slice(*r["rows"])], atol=1e-5, rtol=0,
                                   msg=lambda m: f"rank {rank}: {m}")
        # sequence-parallel compute takes the scattered rows; the plain FFN every DP rank's
        want = [r["total"] if k == "plain" else r["scattered"] for k in KINDS]
        assert r["compute_rows"] == want, (rank, r["compute_rows"])
        check_ledger(r, tp, dp, policy, counts)


def gather_group(tp: int, dp: int) -> str:
    """The group a gather of every DP rank's rows from the scattered slices runs on: without
    attention DP a DP rank's rows are the global rows (attention TP, the same ranks as TP);
    with attention TP 1 the slices are the DP ranks' rows."""
    return "attn_tp" if dp == 1 else "attn_dp" if dp == tp else "tp"


def check_ledger(r: dict, tp: int, dp: int, policy: str, counts) -> None:
    """Each sequence-parallel stage's compute ran one gather in and one reduce-scatter out,
    over its linears' group, moving every row of that group once (rs: each DP rank's rows
    padded to attn_tp chunks of the largest one's size), and its prepare moved nothing. A
    plain stage's prepare gathers its input and the next prepare reduce-scatters its sum."""
    attn_tp = tp // dp
    chunk = -(-max(counts) // attn_tp)
    local = chunk * attn_tp if policy == "rs" else r["local"]
    total = chunk * attn_tp * dp if policy == "rs" else r["total"]
    sites: dict[str, list] = {}
    for site, kind, group, numel in r["ledger"]:
        sites.setdefault(site, []).append((kind, group, numel))
    after_plain = False
    for name, kind in zip(r["names"], KINDS):
        prepare = sites.get(f"{name}.prepare", [])
        compute = sites.get(f"{name}.compute", [])
        want_prepare = [("reduce_scatter", "tp", total * HIDDEN)] if after_plain else []
        after_plain = kind == "plain"
        if kind == "plain":
            want_prepare.append(("all_gather", gather_group(tp, dp), total * HIDDEN))
            want_compute = []
        elif kind == "attn":
            want_compute = [("all_gather", "attn_tp", local * HIDDEN),
                            ("reduce_scatter", "attn_tp", local * HIDDEN)] if (
                attn_tp > 1 and local) else []  # a DP rank with no rows moves none
        else:
            want_compute = [("all_gather", gather_group(tp, dp), total * HIDDEN),
                            ("reduce_scatter", "tp", total * HIDDEN)]
        assert (prepare, compute) == (want_prepare, want_compute), (name, prepare, compute)


# ------------------------------------------------------------------------------- misuse


def sp_stack(tp: int = 1, policy: str = "rs", dp: int = 1, **kwargs):
    rt = runtime(tp, dp, boundary_reduction=policy, batch_variants=(BatchVariant.ORDINARY, SP),
                 **kwargs)
    attn, ffn = make_stages((declare_attn(sequence_parallel=True), toy_norm(1)),
                            (declare_ffn(sequence_parallel=True), toy_norm(2)),
                            terminal=True, runtime=rt, name="layer0")
    return rt, attn, ffn


def misuse(case: str) -> str:
    """What one misuse raises on this rank of a tp=2 world (before any collective). The
    wrong group needs attention DP 2: without it attention TP and TP are the same ranks."""
    dp = 2 if case == "wrong_group" else 1
    rt, attn, ffn = sp_stack(2, dp=dp, rs_padding=case != "uneven_without_padding")
    b = DpBatch((5,) * dp, rt)
    b.fb.variant = SP
    residual_batch.start(b.fb)
    try:
        x = attn.prepare(seeded((5, HIDDEN), 1), b.fb)
        if case == "finish_without_exit":
            attn.finish(x, b.fb)
        elif case == "wrong_group":  # an attention's scope, a linear over the whole TP group
            with attn.exit(b.fb):
                LinearPair(rt.parallel.tp_group, 0, False)(x)
    except (RuntimeError, ValueError) as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case,message", [
    ("finish_without_exit", "^stage layer0.attn computes on scattered rows in a "
                            r"sequence-parallel batch: run its compute inside exit\(\)"),
    ("wrong_group", "^a ColumnParallelLinear over group tp \\[0, 1\\] runs inside a "
                    "sequence-parallel scope over attn_tp \\[\\d\\]"),
    ("uneven_without_padding", "^a sequence-parallel batch keeps its residual scattered over "
                               "attention TP and has no ar path: rs needs padding")])
def test_sequence_parallel_misuse_is_named(case, message):
    import re

    for got in get_pool(2).run(misuse, case):
        assert re.search(message, got), got


def test_sequence_parallel_needs_a_reduce_scatter_policy():
    """Refused by the runtime itself (the table of combination rules), before any stage."""
    from layer_boundary.capabilities import CapabilityError

    with pytest.raises(CapabilityError, match="^--sequence-parallel needs a scattered residual: "
                                              r"--boundary-reduction ar \(BoundaryRuntime."
                                              r"boundary_reduction\) permits no reduce-scatter"):
        sp_stack_on_virtual_ranks("ar")


def sp_stack_on_virtual_ranks(policy: str):
    from layer_boundary.runtime import BoundaryRuntime
    from layer_boundary.runtime.parallel import ParallelDims, virtual_parallel

    rt = BoundaryRuntime(virtual_parallel(ParallelDims(world_size=2, tp=2)),
                         boundary_reduction=policy, batch_variants=(BatchVariant.ORDINARY, SP))
    return make_stages((declare_attn(sequence_parallel=True), toy_norm(1)),
                       (declare_ffn(sequence_parallel=True), toy_norm(2)),
                       terminal=True, runtime=rt, name="layer0")


def test_sequence_parallel_declarations_that_cannot_hold():
    with pytest.raises(ValueError, match="a sparse FFN's experts are not column- and "
                                         "row-parallel linears"):
        declare_ffn(sparse=True, sequence_parallel=True)
    from layer_boundary import ProducerReduction

    with pytest.raises(ValueError, match="a LOCAL_TAIL FFN adds its tail after its own sum"):
        declare_ffn(reduction=ProducerReduction.LOCAL_TAIL, sequence_parallel=True)


def test_a_stage_built_without_the_variant_refuses_the_batch():
    rt = runtime()  # ordinary batches only
    attn, _ = make_stages((declare_attn(sequence_parallel=True), toy_norm(1)),
                          (declare_ffn(sequence_parallel=True), toy_norm(2)), terminal=True,
                          runtime=rt, name="layer0")
    b = DpBatch((3,), rt)
    b.fb.variant = SP
    residual_batch.start(b.fb)
    with pytest.raises(RuntimeError, match="^no stage boundary path for the active "
                                           "sequence-parallel batch$"):
        attn.prepare(seeded((3, HIDDEN), 1), b.fb)
