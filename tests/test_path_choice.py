"""``auto`` chooses per batch: a scattered path only where it sends fewer rows than ar (it
issues twice the collectives) and a DP rank holds at least attn_tp rows; an explicit policy
keeps its own preference. On real ranks: a one-token-per-DP-rank decode under ``auto`` issues
exactly the collectives of ``ar``, while the long skewed prefill before it takes rsv and
moves fewer bytes than ``ar`` does."""

from __future__ import annotations

from dataclasses import replace

import pytest
from distributed.checks import assert_logits_match
from distributed.pool import get_pool

from layer_boundary.row_modes import layer_rows_moved, select_mode
from layer_boundary.layout import RowMode
from layer_boundary.engine.runner import RunSpec, merge, run_rank
from layer_boundary.runtime import (BatchVariant, BoundaryRuntime, ParallelDims,
                                    virtual_parallel)


def _runtime(tp, dp, policy="rs+rsv", by_bytes=True):
    return BoundaryRuntime(virtual_parallel(ParallelDims(world_size=tp, tp=tp, attn_dp=dp)),
                           boundary_reduction=policy, choose_by_bytes=by_bytes)


@pytest.mark.parametrize("tp,dp,counts,mode,why", [
    (4, 2, (1, 1), RowMode.AR, "each DP rank holds at most 1 rows, fewer than attn_tp=2"),
    (4, 2, (0, 1), RowMode.AR, "fewer than attn_tp=2"),
    (4, 2, (40, 3), RowMode.RSV, "rsv"),
    (4, 2, (2, 2), RowMode.RSV, "rsv"),
    (2, 1, (9,), RowMode.AR, "rs would send 20.0 rows x hidden per layer against ar's 18.0"),
    (4, 4, (1, 1, 1, 1), RowMode.RSV, "rsv")])  # attention TP 1: same count, fewer bytes
def test_auto_takes_a_scatter_only_where_it_sends_fewer_rows(tp, dp, counts, mode, why):
    got, reason = select_mode(_runtime(tp, dp), counts)
    assert got is mode and why in reason, (got, reason)
    if mode is RowMode.RSV:
        rt = _runtime(tp, dp)
        assert layer_rows_moved(rt, RowMode.RSV, counts) < layer_rows_moved(rt, RowMode.AR,
                                                                            counts)


def test_an_explicit_policy_and_scattered_variants_keep_their_modes():
    assert select_mode(_runtime(4, 2, by_bytes=False), (1, 1))[0] is RowMode.RSV
    assert select_mode(_runtime(2, 1, "rs", by_bytes=False), (9,))[0] is RowMode.RS
    # a sequence-parallel batch has no ar path: the choice does not apply
    rt = BoundaryRuntime(virtual_parallel(ParallelDims(world_size=2, tp=2)),
                         boundary_reduction="rs+rsv", choose_by_bytes=True,
                         batch_variants=(BatchVariant.ORDINARY, BatchVariant.SEQUENCE_PARALLEL))
    assert select_mode(rt, (1,), variant=BatchVariant.SEQUENCE_PARALLEL)[0] is RowMode.RSV
    # nor to an input-scattered batch, whose path differs from ar's only when scattered
    rt = _runtime(2, 1)
    assert select_mode(rt, (9,), variant=BatchVariant.INPUT_SCATTERED)[0] is RowMode.RS


def test_a_compiled_forward_takes_no_rsv_that_leaves_a_rank_no_rows(monkeypatch):
    """``run --compile --tp 4 --dp 2 --boundary-reduction rsv`` with one request a DP rank hung
    in its decode steps (found by ``sweep --features``): rsv split each DP rank's one row
    [1, 0] over attention TP, the rank with none compiled a graph whose next all-gather did
    not depend on the reduce-scatter, and inductor issued the gather first."""
    import torch

    rsv_only, both = _runtime(4, 2, "rsv", by_bytes=False), _runtime(4, 2, by_bytes=False)
    assert select_mode(rsv_only, (1, 1))[0] is RowMode.RSV  # eager: every rank runs in order
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    mode, why = select_mode(rsv_only, (1, 1))
    assert mode is RowMode.AR and "rsv leaves an attention-TP rank no rows (DP rows [1, 1] vs " \
                                  "attn_tp=2)" in why, why
    assert select_mode(both, (1, 1))[0] is RowMode.RS  # padded: a row on every rank
    assert select_mode(rsv_only, (2, 3))[0] is RowMode.RSV  # a row on every rank
    # a sequence-parallel prefill of one row (it hung too): padded, or refused by name
    variants = (BatchVariant.ORDINARY, BatchVariant.SEQUENCE_PARALLEL)
    sp = [BoundaryRuntime(virtual_parallel(ParallelDims(world_size=2, tp=2)),
                          boundary_reduction=policy, batch_variants=variants)
          for policy in ("rs+rsv", "rsv")]
    assert select_mode(sp[0], (1,), variant=BatchVariant.SEQUENCE_PARALLEL)[0] is RowMode.RS
    with pytest.raises(ValueError, match=r"^a sequence-parallel batch keeps its residual "
                                         r"scattered over attention TP and has no ar path: rsv "
                                         r"leaves an attention-TP rank no rows \(DP rows \[1\]"):
        select_mode(sp[1], (1,), variant=BatchVariant.SEQUENCE_PARALLEL)


@pytest.mark.timeout(120)
def test_one_token_decode_under_auto_runs_the_ar_collectives(qwen3_dir):
    # one long and one short prompt, one per DP rank: a skewed prefill, then decode steps of
    # one token per DP rank
    spec = RunSpec(str(qwen3_dir), tp=4, dp=2, prompts=((3, 1, 4, 1, 5, 9, 2, 6, 5, 8) * 4,
                                                         (7, 7, 2)), max_new_tokens=3)
    auto = get_pool(4).run(run_rank, spec)
    ar = get_pool(4).run(run_rank, replace(spec, boundary_reduction="ar"))
    assert_logits_match(merge(auto), merge(ar), 2)
    for a, b in zip(auto, ar):
        assert a.modes == ["rsv", "ar", "ar"] and b.modes == ["ar"] * 3, a.modes

        def step(r, s):
            return [(e.site, e.kind, e.group, e.numel) for e in r.ledger if e.step == s]

        assert step(a, 1) == step(b, 1) and step(a, 2) == step(b, 2)
        prefill = [sum(e.bytes for e in r.ledger if e.step == 0) for r in (a, b)]
        assert prefill[0] < prefill[1], prefill


def test_a_compiled_sequence_parallel_run_needs_padding_permitted(capsys, restore_logger):
    """Under rsv alone such a run hung (or, with the choice above, failed on every rank inside
    the compiler) on a prefill shorter than attention TP: refused by name before any rank."""
    from distributed.checks import cli

    code, _ = cli(["run", "--tp", "2", "--sequence-parallel", "--compile", "--boundary-reduction",
                   "rsv", "--prompt-ids", "1"], capsys)
    assert code == 2
    assert capsys.readouterr().err == (
        "layer-boundary: error: --sequence-parallel with --compile needs a padded "
        "reduce-scatter permitted (--boundary-reduction rs or rs+rsv): a compiled prefill of "
        "fewer rows than attention TP (2) leaves a rank none under rsv, and every rank's graph "
        "must have the same shapes\n")


def test_the_compiled_choice_traces_with_symbolic_row_counts():
    """``run --compile --tp 2 --boundary-reduction rsv`` on a Nemotron-H failed on every rank
    (found by ``sweep --features``): its row counts reach the choice as symbolic sizes, and
    dynamo has no handler for ``min(parts, default=0)``."""
    import torch

    rsv_only = _runtime(4, 2, "rsv", by_bytes=False)

    @torch.compile(fullgraph=True, backend="eager", dynamic=True)
    def rsv_taken(x):
        mode, _ = select_mode(rsv_only, (x.shape[0], x.shape[0]))
        return x.sum() * 0 + (mode is RowMode.RSV)

    assert rsv_taken(torch.ones(3)).item() == 1  # a row on every rank
    assert rsv_taken(torch.ones(1)).item() == 0  # [1, 1] over attention TP 2: ar


def test_the_batch_invariant_mode_never_chooses_by_bytes():
    """A library runtime built with choose_by_bytes=True, run under ``batch_invariant()``: a
    request alone took ar, in the batch rsv, so its logits were other bits (tp 4, dp 2:
    5e-7 apart); the command line turned the choice off, the library did not."""
    from layer_boundary.runtime.invariant import batch_invariant

    rt = _runtime(4, 2, by_bytes=True)
    assert select_mode(rt, (1, 1))[0] is RowMode.AR  # off the mode: the bytes decide
    with batch_invariant():
        assert select_mode(rt, (1, 1))[0] is select_mode(rt, (40, 3))[0] is RowMode.RSV
