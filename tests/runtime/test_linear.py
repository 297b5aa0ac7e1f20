"""Tensor-parallel linears at tp 2 and 4 on real gloo ranks against a dense F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed.pool import get_pool
from layer_boundary.runtime.context import (NO_FLAGS, OUTSIDE, ForwardFlags, close_scope,
                                            get_forward, open_scope)
from layer_boundary.runtime.ledger import LEDGER
from layer_boundary.runtime.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from layer_boundary.runtime.parallel import ParallelDims, build_parallel

TOL = dict(rtol=1e-5, atol=1e-5)
IN, OUT, T = 12, 16, 5


def _tensors(seed, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


def _group():
    n = dist.get_world_size()
    return build_parallel(ParallelDims(world_size=n, tp=n)).tp_group


def _entries(entries):
    return [(e.kind, e.group, e.group_size, e.numel, e.dtype) for e in entries]


# ------------------------------------------------------------------ column parallel


def _column(weight, bias, x, gather_output):
    group = _group()
    layer = ColumnParallelLinear(weight.shape[1], weight.shape[0], group, bias=bias is not None,
                                 gather_output=gather_output, dtype=weight.dtype)
    layer.weight.weight_loader(layer.weight, weight)
    if bias is not None:
        layer.bias.weight_loader(layer.bias, bias)
    with LEDGER.recording() as entries:
        y = layer(x)
    return group.rank, y, _entries(entries)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("gather_output", [False, True], ids=["local", "gathered"])
def test_column_parallel_matches_dense(tp, bias, gather_output):
    weight, b, x = _tensors(tp, (OUT, IN), (OUT,), (T, IN))
    b = b if bias else None
    dense = F.linear(x, weight, b)
    results = get_pool(tp).run(_column, weight, b, x, gather_output)
    width = OUT // tp
    for r, (group_rank, y, entries) in enumerate(results):
        assert group_rank == r
        if gather_output:
            assert y.shape == (T, OUT)
            torch.testing.assert_close(y, dense, **TOL)
            assert entries == [("all_gather", "tp", tp, T * OUT, torch.float64)]
        else:
            assert y.shape == (T, width)
            torch.testing.assert_close(y, dense[:, r * width:(r + 1) * width], **TOL)
            assert entries == []


# ------------------------------------------------------------------ row parallel


def _row(weight, bias, x, reduce_results, flags):
    group = _group()
    layer = RowParallelLinear(weight.shape[1], weight.shape[0], group, bias=bias is not None,
                              reduce_results=reduce_results, dtype=weight.dtype)
    layer.weight.weight_loader(layer.weight, weight)
    if bias is not None:
        layer.bias.weight_loader(layer.bias, bias)
    k = weight.shape[1] // group.size
    x_local = x[:, group.rank * k:(group.rank + 1) * k]  # input features split contiguously
    # a hand-made exit scope: these flags, no scattered rows, no adapters
    previous = open_scope(OUTSIDE._replace(flags=NO_FLAGS if flags is None else flags))
    try:
        with LEDGER.recording() as entries:
            y = layer(x_local)
    finally:
        close_scope(previous)
    return group.rank, y, _entries(entries), get_forward() is previous.flags


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_reduced_matches_dense(tp):
    weight, bias, x = _tensors(10 + tp, (OUT, IN), (OUT,), (T, IN))
    bias = bias + 3.0  # large enough that a bias added on every rank shows
    dense = F.linear(x, weight, bias)
    results = get_pool(tp).run(_row, weight, bias, x, True, None)
    for r, (group_rank, y, entries, restored) in enumerate(results):
        assert group_rank == r and restored
        torch.testing.assert_close(y, dense, **TOL)
        assert entries == [("all_reduce", "tp", tp, T * OUT, torch.float64)]


def _check_partials(results, weight, bias, x, tp):
    """Every rank holds its own partial sum; the bias is in rank 0's alone; they sum to dense."""
    k = IN // tp
    partials = []
    for r, (group_rank, y, entries, restored) in enumerate(results):
        assert group_rank == r and restored
        assert entries == [], f"rank {r} ran a collective: {entries}"
        own = F.linear(x[:, r * k:(r + 1) * k], weight[:, r * k:(r + 1) * k],
                       bias if r == 0 else None)
        torch.testing.assert_close(y, own, **TOL)
        partials.append(y)
    torch.testing.assert_close(sum(partials), F.linear(x, weight, bias), **TOL)


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_without_reduction_returns_partial_sums(tp):
    weight, bias, x = _tensors(20 + tp, (OUT, IN), (OUT,), (T, IN))
    bias = bias + 3.0
    results = get_pool(tp).run(_row, weight, bias, x, False, None)
    _check_partials(results, weight, bias, x, tp)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize(
    "flags",
    [ForwardFlags(fuse_mlp_allreduce=True), ForwardFlags(mlp_reduce_scatter=True),
     ForwardFlags(fuse_mlp_allreduce=True, mlp_reduce_scatter=True)],
    ids=["fuse_mlp_allreduce", "mlp_reduce_scatter", "both"],
)
def test_row_parallel_leaves_the_sum_to_the_boundary_under_flags(tp, flags):
    weight, bias, x = _tensors(30 + tp, (OUT, IN), (OUT,), (T, IN))
    bias = bias + 3.0
    results = get_pool(tp).run(_row, weight, bias, x, True, flags)
    _check_partials(results, weight, bias, x, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_reduces_under_flags_that_do_not_skip(tp):
    weight, bias, x = _tensors(40 + tp, (OUT, IN), (OUT,), (T, IN))
    flags = ForwardFlags(defer_moe_finalize=True)
    results = get_pool(tp).run(_row, weight, bias, x, True, flags)
    dense = F.linear(x, weight, bias)
    for _group_rank, y, entries, restored in results:
        assert restored
        torch.testing.assert_close(y, dense, **TOL)
        assert [e[0] for e in entries] == ["all_reduce"]


# ------------------------------------------------------------------ fused qkv


def _qkv(hidden, head_dim, num_heads, num_kv_heads, weights, biases, x):
    group = _group()
    layer = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, group, bias=True,
                              dtype=x.dtype)
    for shard_id in "qkv":
        layer.weight.weight_loader(layer.weight, weights[shard_id], shard_id)
        layer.bias.weight_loader(layer.bias, biases[shard_id], shard_id)
    y = layer(x)
    q, k, v = y.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
    return group.rank, q, k, v


@pytest.mark.parametrize(
    "tp, num_heads, num_kv_heads",
    [(2, 8, 2), (4, 8, 2), (2, 8, 8), (4, 8, 8)],
    ids=["tp2-h8-kv2", "tp4-h8-kv2-replicated", "tp2-h8-kv8", "tp4-h8-kv8"],
)
def test_qkv_slices_are_the_heads_each_rank_owns(tp, num_heads, num_kv_heads):
    hidden, head_dim = 12, 4
    shapes = [(num_heads * head_dim, hidden), (num_kv_heads * head_dim, hidden),
              (num_kv_heads * head_dim, hidden), (num_heads * head_dim,),
              (num_kv_heads * head_dim,), (num_kv_heads * head_dim,), (T, hidden)]
    wq, wk, wv, bq, bk, bv, x = _tensors(50 + tp + num_kv_heads, *shapes)
    weights, biases = dict(q=wq, k=wk, v=wv), dict(q=bq, k=bk, v=bv)
    dense = {s: F.linear(x, weights[s], biases[s]).view(T, -1, head_dim) for s in "qkv"}

    # Query heads split evenly in rank order. kv heads: split evenly when there are at
    # least tp of them; otherwise head h is replicated on tp // num_kv_heads consecutive ranks.
    q_per = num_heads // tp
    if num_kv_heads >= tp:
        kv_heads = [list(range(r * num_kv_heads // tp, (r + 1) * num_kv_heads // tp))
                    for r in range(tp)]
    else:
        kv_heads = [[r * num_kv_heads // tp] for r in range(tp)]
    owners = [h for heads in kv_heads for h in heads]
    assert sorted(set(owners)) == list(range(num_kv_heads))  # every kv head lives somewhere
    assert all(owners.count(h) == max(1, tp // num_kv_heads) for h in range(num_kv_heads))

    results = get_pool(tp).run(_qkv, hidden, head_dim, num_heads, num_kv_heads, weights, biases, x)
    for r, (group_rank, q, k, v) in enumerate(results):
        assert group_rank == r
        want_q = dense["q"][:, r * q_per:(r + 1) * q_per].reshape(T, -1)
        torch.testing.assert_close(q, want_q, **TOL)
        for name, got in (("k", k), ("v", v)):
            want = dense[name][:, kv_heads[r]].reshape(T, -1)
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {r} {name}: {m}")


@pytest.mark.parametrize("tp, num_heads, num_kv_heads", [(4, 6, 2), (4, 8, 3), (2, 8, 3)])
def test_qkv_rejects_heads_that_do_not_fit(tp, num_heads, num_kv_heads):
    from layer_boundary.runtime.parallel import Group

    group = Group("tp", tuple(range(tp)), 0)  # construction only: no collective is run
    with pytest.raises(ValueError):
        QKVParallelLinear(8, 4, num_heads, num_kv_heads, group)
