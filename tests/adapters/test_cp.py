"""The CP mapping, ``cp_view`` and a CP batch's misuse.

The mapping is checked against its definition written independently here (every request cut
into 2 x cp balanced chunks with ``torch.tensor_split``, CP rank r taking chunks r and
2cp-1-r); ``cp_view`` on real ranks against the world-1 tokens; misuse gets a named error on
every rank, before any collective (no hang)."""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from hypothesis import given, settings
from hypothesis import strategies as st
from toy import HIDDEN, DpBatch, ToyLayer, runtime, seeded

from layer_boundary import cp_view
from layer_boundary.construction import CP_NEEDS_LENS, UnsupportedBoundary
from layer_boundary.ops import cp_share_sizes, cp_shares
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime import BatchVariant, BoundaryRuntime
from layer_boundary.runtime.parallel import ParallelDims, virtual_parallel


def reference_shares(lens, cp: int) -> list[list[int]]:
    shares = [[] for _ in range(cp)]
    offset = 0
    for n in lens:
        chunks = torch.arange(offset, offset + n).tensor_split(2 * cp)
        for r in range(cp):
            shares[r] += chunks[r].tolist() + chunks[2 * cp - 1 - r].tolist()
        offset += n
    return shares


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=6), st.sampled_from([1, 2, 3, 4, 8]))
def test_the_mapping_is_the_balanced_two_chunk_split(lens, cp):
    shares = cp_shares(lens, cp)
    assert [list(s) for s in shares] == reference_shares(lens, cp)
    # a partition of the DP rank's tokens; every rank's causal work within one chunk's
    assert sorted(i for s in shares for i in s) == list(range(sum(lens)))
    assert cp_share_sizes(lens, cp) == tuple(len(s) for s in shares)
    for n in lens:
        sizes = cp_share_sizes((n,), cp)
        assert max(sizes) - min(sizes) <= 2


def test_short_requests_leave_ranks_empty():
    # 3 tokens over cp 2: chunks of 1, 1, 1, 0; rank 0 takes chunks 0 and 3
    assert cp_shares((3,), 2) == ((0,), (1, 2))
    # one-token requests (a decode step) all land on CP rank 0
    assert cp_shares((1, 1, 1), 4) == ((0, 1, 2), (), (), ())
    assert cp_shares((), 2) == ((), ())


def view_on_ranks(tp: int, dp: int, cp: int, lens) -> dict:
    """cp_view after the stack's first boundary: the share, its positions, the gather."""
    rt = runtime(tp, dp, cp)
    layer = ToyLayer(rt, 0, 1)
    counts = tuple(map(sum, lens))
    b = DpBatch(counts, rt, lens)
    fb = b.fb
    assert cp_view(fb) is None  # nothing placed yet
    residual_batch.start(fb)
    h = layer.attn.prepare(b.mine(seeded((sum(counts), HIDDEN), 1)), fb)
    view = cp_view(fb)
    local = torch.arange(counts[rt.parallel.attn_dp_rank], dtype=torch.float64)[:, None]
    out = {"queries": view.queries.tolist(), "share": view.share(local).flatten().tolist(),
           "positions": view.share(fb.positions).tolist(), "rows": h.shape[0],
           "gathered": view.gather(view.share(local)).flatten().tolist(),
           "local": local.flatten().tolist(), "expected": (b.share - b.start).tolist(),
           "expected_positions": fb.positions[b.share - b.start].tolist(),
           # per-token facts onto each stage's compute rows: attention's share, the FFN's
           # every DP rank's tokens (global order)
           "attn_rows": layer.attn.to_compute_rows(local + b.start, fb).flatten().tolist(),
           "ffn_rows": layer.ffn.to_compute_rows(local + b.start, fb).flatten().tolist(),
           "share_global": b.share.tolist(), "total": sum(counts)}
    residual_batch.norm(layer.attn.finish(layer.attn_compute(h), fb), fb, layer.ffn_norm)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,cp,lens", [(2, 1, 2, ((6, 3),)), (4, 1, 4, ((3,),)),
                                           (4, 2, 2, ((5, 2), ())), (4, 1, 2, ((1, 1),))])
def test_cp_view_gives_attention_its_share(tp, dp, cp, lens):
    for r in get_pool(tp).run(view_on_ranks, tp, dp, cp, lens):
        assert r["queries"] == r["share"] == r["expected"]
        assert r["rows"] == len(r["expected"])  # attention's input rows are the share
        assert r["positions"] == r["expected_positions"]  # positions within each request
        assert r["gathered"] == r["local"]  # every token of the DP rank, in token order
        assert r["attn_rows"] == r["share_global"]
        assert r["ffn_rows"] == list(range(r["total"]))


def test_no_cp_view_outside_a_cp_batch():
    layer, b = ToyLayer(runtime(), 0, 1), DpBatch((3,), runtime())
    residual_batch.start(b.fb)
    layer.attn.prepare(seeded((3, HIDDEN), 1), b.fb)
    assert cp_view(b.fb) is None


# ------------------------------------------------------------------------------- misuse


def misuse(case: str) -> str:
    """The error one misuse raises on this rank (every rank raises it before any
    collective, so none waits for a peer)."""
    rt, lens = runtime(4, 2, 2), ((3,), (2,))
    layer = ToyLayer(rt, 0, 1)
    b = DpBatch(tuple(map(sum, lens)), rt, lens)
    if case == "no_lens":
        b.fb.dp_request_lens = None
    elif case == "wrong_lens":
        b.fb.dp_request_lens = ((2, 1), (1,))
    elif case == "ordinary_variant_on_cp":
        b.fb.variant = BatchVariant.ORDINARY
    residual_batch.start(b.fb)
    try:
        layer.attn.prepare(b.mine(seeded((5, HIDDEN), 1)), b.fb)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case,message", [
    ("no_lens", f"^{CP_NEEDS_LENS.replace('(', '[(]').replace(')', '[)]')}$"),
    ("wrong_lens", r"^ForwardBatch.dp_request_lens \(\(2, 1\), \(1,\)\) does not describe the "
                   r"CP batch: DP token counts \(3, 2\)"),
    ("ordinary_variant_on_cp", "^no stage boundary path for the active ordinary batch$")])
def test_cp_batch_misuse_is_named_on_every_rank(case, message):
    import re

    for got in get_pool(4).run(misuse, case):
        assert re.search(message, got), got


def test_a_cp_batch_on_a_stage_without_a_cp_path():
    # the runtime admits CP batches, but this topology has no attention CP: no stage builds
    # a CP path, and a CP batch is refused with the spec's message
    rt = runtime(batch_variants=(BatchVariant.ORDINARY, BatchVariant.CP))
    layer, b = ToyLayer(rt, 0, 1), DpBatch((3,), rt)
    b.fb.variant = BatchVariant.CP
    residual_batch.start(b.fb)
    with pytest.raises(RuntimeError, match="^no stage boundary path for the active CP batch$"):
        layer.attn.prepare(seeded((3, HIDDEN), 1), b.fb)


def test_a_cp_topology_needs_the_cp_variant():
    rt = BoundaryRuntime(virtual_parallel(ParallelDims(world_size=2, tp=2, attn_cp=2)))
    with pytest.raises(UnsupportedBoundary, match="attn_cp=2 splits each batch over CP ranks: "
                                                  "the runtime's batch_variants must include "
                                                  "BatchVariant.CP"):
        ToyLayer(rt, 0, 1)
