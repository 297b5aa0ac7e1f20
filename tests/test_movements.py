"""Every row of the movement table keeps its row contract, on real gloo ranks.

For each topology, row mode and DP load, every movement the table resolves is run on real
ranks. Each rank starts from the rows its source layout gives it of one global tensor (a
partial owed over a group: that tensor scaled by the rank's index in the group, plus one),
and must end with exactly the rows its destination layout gives it, summed where a sum was
owed. What the ledger records must be what the movement's own expectation says.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed.pool import get_pool
from toy import cp_case_id

from layer_boundary.layout import RowMode, SumGroup, sum_group
from layer_boundary.ops import movement_table, row_facts
from layer_boundary.runtime import LEDGER, ParallelDims, build_parallel

WIDTH = 3


def run_table(tp: int, dp: int, mode: str, counts, cp: int = 1, request_lens=None) -> list:
    par = build_parallel(ParallelDims(world_size=dist.get_world_size(), tp=tp, attn_dp=dp,
                                      attn_cp=cp))
    mode = RowMode(mode)
    rows = row_facts(mode, counts, par, request_lens)
    total = sum(counts)
    full = torch.arange(total * WIDTH, dtype=torch.float64).view(total, WIDTH) + 1
    out = []
    for key, movement in movement_table(par, mode, cp=request_lens is not None).items():
        if key == "layouts":
            continue
        src_rows = full[rows.global_indices(movement.src)]
        scale = 1.0
        if movement.owed is not None:
            group = sum_group(par, movement.owed)
            src_rows = src_rows * (group.rank + 1)
            scale = group.size * (group.size + 1) / 2
        with LEDGER.recording() as ledger:
            got = movement.move(rows, src_rows.clone())
        want = full[rows.global_indices(movement.dst)] * scale
        recorded = [(e.kind, e.group, e.numel) for e in ledger]
        out.append((movement.name, str(movement.src), str(movement.dst),
                    None if movement.owed is None else movement.owed.value,
                    torch.equal(got, want), recorded == movement.expected(rows, WIDTH),
                    got.shape[0] == rows.count(movement.dst)))
    return out


def assert_contracts_kept(results) -> None:
    for rank, rows in enumerate(results):
        for name, src, dst, owed, values, ledger, count in rows:
            what = f"rank {rank}: {name} ({owed or 'complete'}: {src} -> {dst})"
            assert values, f"{what}: wrong rows or values"
            assert ledger, f"{what}: the ledger differs from the movement's expectation"
            assert count, f"{what}: row count"


CASES = [(2, 1, "ar", (5,)), (2, 1, "rs", (5,)), (4, 1, "rs", (5,)), (4, 1, "rs", (8,)),
         (4, 2, "ar", (5, 3)), (4, 2, "rs", (5, 3)), (4, 2, "rsv", (5, 3)),
         (4, 2, "rs", (5, 0)), (4, 2, "rsv", (0, 5)), (4, 2, "rsv", (0, 0)),
         (4, 4, "rs", (2, 0, 3, 1)), (4, 4, "rsv", (2, 0, 3, 1)), (2, 2, "ar", (3, 0))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,mode,counts", CASES,
                         ids=[f"tp{t}-dp{d}-{m}-{'_'.join(map(str, c))}" for t, d, m, c in CASES])
def test_every_movement_keeps_its_contract(tp, dp, mode, counts):
    results = get_pool(tp).run(run_table, tp, dp, mode, counts)
    assert results[0], "the table resolved no movement"
    assert_contracts_kept(results)


# CP batches: (tp, attn_dp, attn_cp, mode, every DP rank's request lengths). attn_tp 2 and
# 1; a request shorter than 2 x cp (some CP shares empty), one-token requests (a decode
# step: every token on CP rank 0), an empty DP rank, a batch with no tokens at all
CP_CASES = [(2, 1, 2, "ar", ((5,),)), (2, 1, 2, "rs", ((9, 2),)), (2, 1, 2, "rsv", ((3,),)),
            (4, 1, 2, "ar", ((7, 3),)), (4, 1, 2, "rs", ((7, 3),)), (4, 1, 2, "rsv", ((9, 1, 2),)),
            (4, 1, 2, "rsv", ((1, 1, 1),)),
            (4, 1, 4, "ar", ((3,),)), (4, 1, 4, "rs", ((10, 3),)), (4, 1, 4, "rsv", ((10, 3),)),
            (4, 2, 2, "ar", ((5, 3), (2,))), (4, 2, 2, "rs", ((5, 3), (2,))),
            (4, 2, 2, "rsv", ((5, 3), (2,))), (4, 2, 2, "rsv", ((), (1,))),
            (4, 2, 2, "rs", ((4,), ())), (4, 2, 2, "rsv", ((), ()))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,cp,mode,lens", CP_CASES,
                         ids=[cp_case_id(*case) for case in CP_CASES])
def test_every_cp_movement_keeps_its_contract(tp, dp, cp, mode, lens):
    counts = tuple(sum(per) for per in lens)
    results = get_pool(tp).run(run_table, tp, dp, mode, counts, cp, lens)
    names = {name for name, *_ in results[0]}
    # the CP rows themselves resolved: a gather over CP and a select of the share
    assert {"all_gather_v(attn_cp)", "select(attn_cp)"} <= names, names
    assert_contracts_kept(results)


def test_the_tables_cover_what_the_stages_need():
    """The transitions a decoder layer needs exist in every mode of a DP topology."""
    par = build_parallel(ParallelDims())  # world 1: one layout; every key still resolves
    for mode in RowMode:
        table = movement_table(par, mode)
        layouts = table.layouts
        for owed in (None, SumGroup.ATTN_TP, SumGroup.TP, SumGroup.MOE_OUT):
            assert (owed, layouts.local.key, layouts.residual(mode).key) in table, (mode, owed)
