"""The row contracts runtime/collectives.py states, one line each, checked on real gloo ranks.

all_reduce_rows:  "Rows unchanged; every rank ends with the group sum of its rows (reuses
                   ``x``'s storage)."
gather_last_dim:  "Rows unchanged; the last dim becomes the concatenation of every rank's
                   slice in rank order."
A size-1 group short-circuits: the input object itself comes back, nothing is recorded.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from distributed.pool import get_pool  # tests/ is on sys.path (tests/conftest.py)
from layer_boundary.runtime import collectives as ops
from layer_boundary.runtime.agreement import checking
from layer_boundary.runtime.collectives import all_reduce_rows, gather_last_dim
from layer_boundary.runtime.ledger import LEDGER
from layer_boundary.runtime.parallel import Group, ParallelDims, build_parallel


def _inputs(world, shape, seed):
    """Integer-valued float64 tensors, distinct per rank and per row, so sums are exact."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-1000, 1000, shape, generator=g).double() for _ in range(world)]


def _group(kwargs, name):
    n = dist.get_world_size()
    return getattr(build_parallel(ParallelDims(world_size=n, **kwargs)), f"{name}_group")


def _all_reduce(kwargs, name, xs, transpose):
    group = _group(kwargs, name)
    x = xs[dist.get_rank()].clone()
    if transpose:
        x = x.t()  # non-contiguous input: the rows are the transpose's rows
    ptr = x.data_ptr()
    y = all_reduce_rows(x, group)
    return group.ranks, y, y.data_ptr() == ptr


def _gather(kwargs, name, xs, transpose):
    group = _group(kwargs, name)
    x = xs[dist.get_rank()].clone()
    if transpose:
        x = x.transpose(-1, -2)
    before = x.clone()
    y = gather_last_dim(x, group)
    return group.ranks, y, torch.equal(x, before)


# (world, dims, group): the attn_dp group of tp=4, attn_dp=2 holds world ranks {0, 2} and
# {1, 3}, so "rank order" there means group-rank order over non-adjacent world ranks.
GROUPS = [
    (2, dict(tp=2), "tp"),
    (4, dict(tp=4), "tp"),
    (4, dict(tp=4, attn_dp=2), "attn_tp"),
    (4, dict(tp=4, attn_dp=2), "attn_dp"),
]
GROUP_IDS = [f"w{w}-{'-'.join(f'{k}{v}' for k, v in kw.items())}-{name}" for w, kw, name in GROUPS]


@pytest.mark.parametrize("transpose", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("world, kwargs, name", GROUPS, ids=GROUP_IDS)
def test_all_reduce_rows_sums_each_row_over_the_group(world, kwargs, name, transpose):
    xs = _inputs(world, (6, 5), seed=world)
    results = get_pool(world).run(_all_reduce, kwargs, name, xs, transpose)
    for r, (ranks, y, same_storage) in enumerate(results):
        assert r in ranks
        expected = sum(xs[q] for q in ranks)
        if transpose:
            expected = expected.t()
        assert torch.equal(y, expected), f"rank {r}"
        if not transpose:
            assert same_storage, f"rank {r}: result does not reuse the input's storage"


@contextlib.contextmanager
def _torch_calls(*names):
    """Inside, each call of the named ``torch.distributed`` functions appends its name to the
    list this yields (and then runs)."""
    ran = []
    calls = {f: getattr(dist, f) for f in names}
    for f, call in calls.items():
        setattr(dist, f, lambda *a, _f=f, _call=call, **k: ran.append(_f) or _call(*a, **k))
    try:
        yield ran
    finally:
        for f, call in calls.items():
            setattr(dist, f, call)


def _sum_paths(kwargs, name, small, large):
    """A small sum, one over ``GATHER_SUM_MAX_BYTES`` and the small one issued asynchronously:
    each result, its ledger entry and which torch call ran."""
    group = _group(kwargs, name)
    # which torch call a sum runs, alone (the agreement check's exchange is a gather too)
    with checking(False), _torch_calls("all_reduce", "all_gather_single") as ran, \
            LEDGER.recording() as entries:
        out = [all_reduce_rows(small[dist.get_rank()].clone(), group),
               all_reduce_rows(large[dist.get_rank()].clone(), group)]
        with ops.issuing_async() as issued:
            x = all_reduce_rows(small[dist.get_rank()].clone(), group)
        for work, _ in issued:
            work.wait()
        out.append(x)
    return group.ranks, out, list(entries), ran


@pytest.mark.parametrize("world, kwargs, name", GROUPS[:3], ids=GROUP_IDS[:3])
def test_a_small_sum_on_gloo_runs_as_a_gather_and_the_same_local_sum_everywhere(world, kwargs,
                                                                               name):
    g = torch.Generator().manual_seed(5)
    small = [torch.randn(3, 64, generator=g) for _ in range(world)]  # not exact in float32
    # float64 rows over the limit for the smallest group here (2 ranks), so for every one
    rows = ops.GATHER_SUM_MAX_BYTES // (2 * 64 * 8) + 1
    large = _inputs(world, (rows, 64), seed=6)
    results = get_pool(world).run(_sum_paths, kwargs, name, small, large)
    sums = []
    for r, (ranks, (gathered, over, issued), entries, ran) in enumerate(results):
        assert ran == ["all_gather_single", "all_reduce", "all_reduce"], f"rank {r}"
        # summed here in group rank order: that exact float32 sum, on every rank
        assert torch.equal(gathered, torch.stack([small[q] for q in ranks]).sum(0))
        assert torch.equal(over, sum(large[q] for q in ranks))
        torch.testing.assert_close(issued, gathered)  # the all-reduce's own rounding
        sums.append(gathered)
        small_bytes = 3 * 64 * 4
        kinds = [(e.kind, e.numel, e.wire_kind) for e in entries]
        assert kinds == [("all_reduce", 3 * 64, "all_gather"), ("all_reduce", rows * 64, None),
                         ("all_reduce", 3 * 64, None)]
        # the logical figure stays the all-reduce's; gloo's wire carries the gather
        assert entries[0].bytes == 2 * (len(ranks) - 1) * small_bytes // len(ranks)
        assert entries[0].wire_bytes() == (len(ranks) - 1) * small_bytes
        assert entries[0].wire_bytes("nccl") == entries[0].bytes
        assert entries[2].wire_bytes() == entries[2].bytes
    for ranks, *_ in results:  # every rank of a group holds bit-identical sums
        members = [sums[q] for q, (rk, *_) in enumerate(results) if rk == ranks]
        assert all(torch.equal(m, members[0]) for m in members)


@pytest.mark.parametrize("transpose", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("world, kwargs, name", GROUPS, ids=GROUP_IDS)
def test_gather_last_dim_concatenates_in_rank_order(world, kwargs, name, transpose):
    xs = _inputs(world, (2, 3, 4), seed=10 + world)  # 3-D: the last dim, not dim 1, grows
    results = get_pool(world).run(_gather, kwargs, name, xs, transpose)
    for r, (ranks, y, input_kept) in enumerate(results):
        assert r in ranks
        parts = [xs[q].transpose(-1, -2) if transpose else xs[q] for q in ranks]
        assert y.shape == (*parts[0].shape[:-1], parts[0].shape[-1] * len(ranks))
        assert torch.equal(y, torch.cat(parts, dim=-1)), f"rank {r}"
        assert input_kept, f"rank {r}: gather_last_dim changed its input"


def _empty_rows(kwargs, name):
    group = _group(kwargs, name)
    x = torch.empty(0, 3)
    with LEDGER.recording() as entries:
        reduced = all_reduce_rows(x, group)
        gathered = gather_last_dim(x, group)
    return group.size, reduced.shape, gathered.shape, len(entries)


@pytest.mark.parametrize("world, kwargs, name", GROUPS, ids=GROUP_IDS)
def test_no_rows_anywhere_skip_the_collective_but_keep_the_shapes(world, kwargs, name):
    for n, reduced, gathered, recorded in get_pool(world).run(_empty_rows, kwargs, name):
        assert reduced == (0, 3) and gathered == (0, 3 * n) and recorded == 0


def _size1_in_world(x):
    par = build_parallel(ParallelDims(world_size=dist.get_world_size(), tp=4, attn_dp=4))
    with LEDGER.recording() as entries:
        group = par.attn_tp_group
        same = all_reduce_rows(x, group) is x and gather_last_dim(x, group) is x
    return par.attn_tp_group.size, same, len(entries)


def test_size1_group_inside_a_world_returns_the_input_itself():
    results = get_pool(4).run(_size1_in_world, torch.arange(6.0).view(2, 3))
    assert results == [(1, True, 0)] * 4


class _NoDist:
    def __getattr__(self, name):
        raise AssertionError(f"a size-1 group touched torch.distributed.{name}")


@pytest.mark.parametrize("op", [all_reduce_rows, gather_last_dim])
def test_size1_group_returns_the_input_object_itself(op, monkeypatch):
    monkeypatch.setattr(ops, "dist", _NoDist())
    group = Group("tp", (0,), 0)
    x = torch.randn(4, 3).t()  # non-contiguous too: no copy may be made
    with LEDGER.recording() as entries:
        assert op(x, group) is x
    assert entries == []


# ------------------------------------------------------------------ row-moving collectives


def _row_op(kwargs, name, op_name, rows, sizes, width, seed):
    """Rank side: build this rank's rows, run ``op_name``, return inputs, output and ledger."""
    group = _group(kwargs, name)
    if sizes is not None and op_name == "gather_rows_v":
        rows = sizes[group.rank]
    g = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    x = torch.randint(-1000, 1000, (rows, width), generator=g).double()
    op = getattr(ops, op_name)
    with LEDGER.recording() as entries:
        y = op(x.clone(), group) if sizes is None else op(x.clone(), group, sizes)
    recorded = [(e.kind, e.group, e.group_size, e.numel) for e in entries]
    return group.ranks, group.rank, x, y, recorded


def _blocks(sizes):
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [slice(s, s + n) for s, n in zip(starts, sizes)]


ROW_GROUPS = [
    (2, dict(tp=2), "tp"),
    (4, dict(tp=4), "tp"),
    (4, dict(tp=4, attn_dp=2), "attn_dp"),
]
ROW_IDS = [f"w{w}-{'-'.join(f'{k}{v}' for k, v in kw.items())}-{name}"
           for w, kw, name in ROW_GROUPS]


def _group_size(kwargs, name):
    return {"tp": kwargs["tp"], "attn_dp": kwargs.get("attn_dp", 1),
            "attn_tp": kwargs["tp"] // kwargs.get("attn_dp", 1)}[name]


@pytest.mark.parametrize("block", [3, 0], ids=["rows", "empty"])
@pytest.mark.parametrize("world, kwargs, name", ROW_GROUPS, ids=ROW_IDS)
def test_reduce_scatter_rows_gives_rank_i_the_sum_of_block_i(world, kwargs, name, block):
    n = _group_size(kwargs, name)
    results = get_pool(world).run(_row_op, kwargs, name, "reduce_scatter_rows", block * n, None,
                                  4, 1)
    xs = [x for _, _, x, _, _ in results]
    for r, (ranks, i, _, y, entries) in enumerate(results):
        assert ranks[i] == r and len(ranks) == n
        rows = slice(i * block, (i + 1) * block)
        assert torch.equal(y, sum(xs[q][rows] for q in ranks)), f"rank {r}"
        want = [("reduce_scatter", name, n, block * n * 4)] if block else []
        assert entries == want, f"rank {r}"


@pytest.mark.parametrize("world, kwargs, name", ROW_GROUPS, ids=ROW_IDS)
def test_gather_rows_concatenates_in_group_rank_order(world, kwargs, name):
    n = _group_size(kwargs, name)
    results = get_pool(world).run(_row_op, kwargs, name, "gather_rows", 3, None, 4, 2)
    xs = [x for _, _, x, _, _ in results]
    for r, (ranks, i, _, y, entries) in enumerate(results):
        assert ranks[i] == r
        assert torch.equal(y, torch.cat([xs[q] for q in ranks])), f"rank {r}"
        assert entries == [("all_gather", name, n, 3 * n * 4)], f"rank {r}"


# block sizes per group rank: uneven, with empty blocks first, in the middle and last
V_SIZES = {2: [(2, 3), (0, 4), (3, 0), (0, 0)], 4: [(3, 0, 2, 1), (0, 0, 0, 5), (1, 1, 1, 1),
                                                    (0, 0, 0, 0)]}


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("world, kwargs, name", ROW_GROUPS, ids=ROW_IDS)
def test_reduce_scatter_rows_v_gives_rank_i_the_sum_of_its_block(world, kwargs, name, case):
    n = _group_size(kwargs, name)
    sizes = V_SIZES[n][case]
    results = get_pool(world).run(_row_op, kwargs, name, "reduce_scatter_rows_v", sum(sizes),
                                  sizes, 4, 3)
    xs = [x for _, _, x, _, _ in results]
    for r, (ranks, i, _, y, entries) in enumerate(results):
        assert ranks[i] == r
        rows = _blocks(sizes)[i]
        assert torch.equal(y, sum(xs[q][rows] for q in ranks)), f"rank {r}"
        want = [("reduce_scatter", name, n, sum(sizes) * 4)] if sum(sizes) else []
        assert entries == want, f"rank {r}"


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("world, kwargs, name", ROW_GROUPS, ids=ROW_IDS)
def test_gather_rows_v_concatenates_every_ranks_rows_in_rank_order(world, kwargs, name, case):
    n = _group_size(kwargs, name)
    sizes = V_SIZES[n][case]
    results = get_pool(world).run(_row_op, kwargs, name, "gather_rows_v", None, sizes, 4, 4)
    xs = [x for _, _, x, _, _ in results]
    for r, (ranks, i, x, y, entries) in enumerate(results):
        assert ranks[i] == r and x.shape[0] == sizes[i]
        assert torch.equal(y, torch.cat([xs[q] for q in ranks])), f"rank {r}"
        # variable-size collectives record the real rows, not gloo's padding
        want = [("all_gather", name, n, sum(sizes) * 4)] if sum(sizes) else []
        assert entries == want, f"rank {r}"


def test_reduce_scatter_rows_rejects_rows_the_group_does_not_divide():
    group = Group("tp", (0, 1, 2), 0)  # raises before any collective
    with pytest.raises(ValueError, match="3"):
        ops.reduce_scatter_rows(torch.zeros(4, 2), group)


@pytest.mark.parametrize("op, extra", [("reduce_scatter_rows", ()), ("gather_rows", ()),
                                       ("reduce_scatter_rows_v", ((5,),)),
                                       ("gather_rows_v", ((5,),))])
def test_size1_group_row_ops_return_the_input_itself(op, extra, monkeypatch):
    monkeypatch.setattr(ops, "dist", _NoDist())
    x = torch.randn(5, 3)
    with LEDGER.recording() as entries:
        assert getattr(ops, op)(x, Group("tp", (0,), 0), *extra) is x
    assert entries == []


# ------------------------------------------------------------- waiting: polled or asleep


def _polls_decided(kwargs, name):
    import os

    group = _group(kwargs, name)
    cores = len(os.sched_getaffinity(0))
    # this host's ranks: the pool's world unless the environment says otherwise (torchrun's)
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or dist.get_world_size())
    return group.polls, group.backend, local, cores


@pytest.mark.parametrize("world, kwargs, name", GROUPS[:2], ids=GROUP_IDS[:2])
def test_a_gloo_group_polls_only_where_the_hosts_ranks_fit_its_cores(world, kwargs, name):
    for polls, backend, local, cores in get_pool(world).run(_polls_decided, kwargs, name):
        assert backend == "gloo"
        assert polls == (local <= cores)
    assert Group("tp", (0,), 0).polls is False  # a size-1 group waits for nothing


def _every_wait(kwargs, name, polls, seed):
    """Every collective of the module with the group's wait forced to ``polls``: results."""
    group = _group(kwargs, name)
    decided = group.polls
    group.__dict__["polls"] = polls  # the cached decision, put back below
    n, r = group.size, group.rank
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    x = torch.randint(-1000, 1000, (2 * n, 3), generator=g).double()
    big = torch.randint(-9, 9, (ops.GATHER_SUM_MAX_BYTES // (n * 3 * 8) + 1, 3),
                        generator=g).double()  # over the gathered-sum limit: all-reduced
    sizes = tuple(range(n))
    try:
        out = [all_reduce_rows(x.clone(), group), all_reduce_rows(big.clone(), group),
               ops.reduce_scatter_rows(x.clone(), group),
               ops.reduce_scatter_rows_v(x[: sum(sizes)].clone(), group, sizes),
               ops.gather_rows(x, group), ops.gather_rows_v(x[:r], group, sizes),
               gather_last_dim(x, group),
               torch.tensor(ops.exchange_counts([r * 10 + j for j in range(n)], group)),
               ops.all_to_all_rows(x, group, [2] * n, [2] * n)]
        with ops.issuing_async() as issued:
            y = all_reduce_rows(x.clone(), group)
        handles = [type(work).__name__ for work, _ in issued]
        for work, _ in issued:
            work.wait()
        out.append(y)
    finally:
        group.__dict__["polls"] = decided
    return group.ranks, x, out, handles


@pytest.mark.parametrize("world, kwargs, name", GROUPS[1:], ids=GROUP_IDS[1:])
def test_polled_and_sleeping_waits_give_the_same_results(world, kwargs, name):
    pool = get_pool(world)
    polled = pool.run(_every_wait, kwargs, name, True, 7)
    slept = pool.run(_every_wait, kwargs, name, False, 7)
    xs = {r: x for r, (_, x, _, _) in enumerate(polled)}
    for r, ((ranks, _, a, handles_a), (_, _, b, handles_b)) in enumerate(zip(polled, slept)):
        assert len(a) == len(b) == 10
        for i, (p, s) in enumerate(zip(a, b)):
            assert torch.equal(p, s), f"rank {r}, collective {i}"
        # inside issuing_async the handed-back work polls exactly where the group does
        assert handles_a == ["_Polled"] and handles_b != ["_Polled"], f"rank {r}"
        # the sums, gathers and exchanges themselves, not merely equal to each other
        i = ranks.index(r)
        assert torch.equal(a[0], sum(xs[q] for q in ranks)) and torch.equal(a[9], a[0])
        assert torch.equal(a[2], sum(xs[q][2 * i: 2 * i + 2] for q in ranks))
        assert torch.equal(a[4], torch.cat([xs[q] for q in ranks]))
        assert a[7].tolist() == [j * 10 + i for j in range(len(ranks))]


class _NeverDone:
    """A work handle that never reports completion (as gloo's reduce-scatter work does)."""

    def __init__(self):
        self.polled = self.waited = 0

    def is_completed(self):
        self.polled += 1
        return False

    def wait(self):
        self.waited += 1


def test_a_poll_gives_up_after_max_polls_and_sleeps_in_wait():
    work = _NeverDone()
    ops._poll(work)
    assert work.polled == ops.MAX_POLLS and work.waited == 1


def _scatter_paths(kwargs, name):
    """A reduce-scatter and a variable one, synchronous, and a reduce-scatter issued
    asynchronously: which torch call ran each, and the results."""
    group = _group(kwargs, name)
    n = group.size
    g = torch.Generator().manual_seed(11 + dist.get_rank())
    x = torch.randint(-1000, 1000, (2 * n, 3), generator=g).double()
    sizes = tuple(range(n))
    with _torch_calls("all_to_all_single", "reduce_scatter_single", "reduce_scatter") as ran:
        out = [ops.reduce_scatter_rows(x, group),
               ops.reduce_scatter_rows_v(x[:sum(sizes)], group, sizes)]
        with ops.issuing_async() as issued:
            y = ops.reduce_scatter_rows(x, group)
        for work, _ in issued:
            work.wait()
        out.append(y)
    return group.ranks, x, out, ran


@pytest.mark.parametrize("world, kwargs, name", ROW_GROUPS, ids=ROW_IDS)
def test_a_synchronous_reduce_scatter_on_gloo_is_an_exchange_of_blocks(world, kwargs, name):
    results = get_pool(world).run(_scatter_paths, kwargs, name)
    xs = {r: x for r, (_, x, _, _) in enumerate(results)}
    for r, (ranks, _, (even, uneven, issued), ran) in enumerate(results):
        assert ran == ["all_to_all_single", "all_to_all_single", "reduce_scatter_single"]
        i = ranks.index(r)
        assert torch.equal(even, sum(xs[q][2 * i: 2 * i + 2] for q in ranks))
        assert torch.equal(issued, even)
        start = sum(range(i))
        assert torch.equal(uneven, sum(xs[q][start: start + i] for q in ranks))
