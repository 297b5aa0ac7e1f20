"""ParallelDims validation and the process groups build_parallel creates, on real gloo ranks."""

from __future__ import annotations

import gc
import itertools
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from distributed.pool import get_pool
from layer_boundary.runtime.collectives import all_reduce_rows, gather_last_dim
from layer_boundary.runtime.ledger import LEDGER
from layer_boundary.runtime.parallel import (ParallelDims, TopologyError, build_parallel,
                                             built_topologies, process_group,
                                             release_parallel)

FACTORS = ("world_size", "pp", "tp", "attn_dp", "attn_cp")


def _names(message: str, name: str, value) -> bool:
    # "tp" must not be satisfied by "attn_tp": "_" is a word character, so \b excludes it
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", message) is not None and (
        str(value) in message
    )


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "kwargs, involved",
    [
        (dict(world_size=0), ["world_size"]),
        (dict(world_size=-2), ["world_size"]),
        (dict(tp=0), ["tp"]),
        (dict(pp=0), ["pp"]),
        (dict(attn_dp=0), ["attn_dp"]),
        (dict(attn_cp=-1), ["attn_cp"]),
        (dict(world_size=2.0, tp=2), ["world_size"]),
        (dict(world_size=2, tp="2"), ["tp"]),
        (dict(world_size=4, tp=2), ["world_size", "pp", "tp"]),
        (dict(world_size=4, tp=4, pp=2), ["world_size", "pp", "tp"]),
        (dict(world_size=6, tp=2, pp=2), ["world_size", "pp", "tp"]),
        (dict(world_size=4, tp=4, attn_dp=3), ["tp", "attn_dp", "attn_cp"]),
        (dict(world_size=4, tp=4, attn_dp=2, attn_cp=4), ["tp", "attn_dp", "attn_cp"]),
        (dict(world_size=6, tp=6, attn_cp=4), ["tp", "attn_dp", "attn_cp"]),
        (dict(world_size=8, tp=4, pp=2, attn_dp=8), ["tp", "attn_dp", "attn_cp"]),
    ],
    ids=lambda v: ",".join(f"{k}={v[k]!r}" for k in v) if isinstance(v, dict) else "",
)
def test_bad_dims_raise_naming_each_factor(kwargs, involved):
    full = dict(world_size=1, tp=1, pp=1, attn_dp=1, attn_cp=1)
    full.update(kwargs)
    with pytest.raises(TopologyError) as info:
        ParallelDims(**kwargs)
    assert isinstance(info.value, ValueError)  # callers may catch it as a ValueError
    message = str(info.value)
    for name in involved:
        assert _names(message, name, full[name]), f"{name}={full[name]!r} not named in {message!r}"


@pytest.mark.parametrize("name", FACTORS)
def test_bool_is_not_a_degree(name):
    kwargs = dict(world_size=1, tp=1, pp=1, attn_dp=1, attn_cp=1)
    kwargs[name] = True  # numerically 1, so every product still fits
    with pytest.raises(TopologyError, match=name):
        ParallelDims(**kwargs)


def test_attn_tp_is_derived_not_a_field():
    assert ParallelDims(world_size=8, tp=8, attn_dp=2, attn_cp=2).attn_tp == 2
    with pytest.raises(TypeError):
        ParallelDims(world_size=2, tp=2, attn_tp=2)  # type: ignore[call-arg]


_degree = st.integers(min_value=-1, max_value=12)


@settings(max_examples=300, deadline=None)
@given(world_size=_degree, tp=_degree, pp=_degree, attn_dp=_degree, attn_cp=_degree)
def test_dims_valid_exactly_when_factors_fit(world_size, tp, pp, attn_dp, attn_cp):
    kwargs = dict(world_size=world_size, tp=tp, pp=pp, attn_dp=attn_dp, attn_cp=attn_cp)
    valid = (
        min(kwargs.values()) >= 1 and world_size == pp * tp and tp % (attn_dp * attn_cp) == 0
    )
    if not valid:
        with pytest.raises(TopologyError):
            ParallelDims(**kwargs)
        return
    dims = ParallelDims(**kwargs)
    assert dims.world_size == dims.pp * dims.tp
    assert dims.tp == dims.attn_dp * dims.attn_cp * dims.attn_tp
    assert isinstance(dims.attn_tp, int) and dims.attn_tp >= 1


@settings(max_examples=200, deadline=None)
@given(
    pp=st.integers(1, 4),
    attn_dp=st.integers(1, 4),
    attn_cp=st.integers(1, 4),
    attn_tp=st.integers(1, 4),
)
def test_dims_built_from_factors_round_trip(pp, attn_dp, attn_cp, attn_tp):
    tp = attn_dp * attn_cp * attn_tp
    dims = ParallelDims(world_size=pp * tp, tp=tp, pp=pp, attn_dp=attn_dp, attn_cp=attn_cp)
    assert dims.attn_tp == attn_tp
    assert dims.world_size == dims.pp * dims.tp
    assert dims.tp == dims.attn_dp * dims.attn_cp * dims.attn_tp


# ------------------------------------------------------------------ world 1


def test_world1_needs_no_distributed_and_ops_short_circuit():
    assert not dist.is_initialized(), "the test process must not have a process group"
    par = build_parallel(ParallelDims())
    assert build_parallel(ParallelDims()) is par  # cached per dims
    assert par.rank == 0 and par.tp_rank == 0 and par.attn_tp_rank == 0 and par.attn_dp_rank == 0
    for group in (par.tp_group, par.attn_tp_group, par.attn_dp_group, par.pp_group):
        assert group.size == 1 and group.ranks == (0,) and group.rank == 0 and group.pg is None
    x = torch.randn(3, 4)
    with LEDGER.recording() as entries:
        assert all_reduce_rows(x, par.tp_group) is x
        assert gather_last_dim(x, par.attn_tp_group) is x
    assert entries == []


def test_multi_rank_dims_without_distributed_raise():
    assert not dist.is_initialized()
    with pytest.raises(TopologyError, match="world_size"):
        build_parallel(ParallelDims(world_size=2, tp=2))


# ------------------------------------------------------------------ groups on 4 real ranks


def _build_for_another_world(world_size):
    try:
        build_parallel(ParallelDims(world_size=world_size, tp=world_size))
    except TopologyError as exc:
        return str(exc)
    return None


def test_dims_for_another_world_size_raise_on_every_rank():
    for message in get_pool(4).run(_build_for_another_world, 2):
        assert message is not None and _names(message, "world_size", 2) and "4" in message


def _layout(kwargs):
    """Rank side: the groups this rank holds and the sums each group's collective gives."""
    par = build_parallel(ParallelDims(world_size=dist.get_world_size(), **kwargs))
    out = {"rank": par.rank, "tp_rank": par.tp_rank, "attn_tp_rank": par.attn_tp_rank,
           "attn_dp_rank": par.attn_dp_rank, "groups": {}}
    for group in (par.tp_group, par.attn_tp_group, par.attn_dp_group, par.pp_group):
        value = torch.tensor([2.0 ** dist.get_rank()], dtype=torch.float64)
        if group.size > 1:
            dist.all_reduce(value, group=group.pg)
        out["groups"][group.name] = (group.ranks, group.rank, group.size, value.item(),
                                     group.pg is None)
    return out


def _expected_layout(world, tp, pp=1, attn_dp=1, attn_cp=1):
    """Coordinates from the documented order: world = pp x tp; tp = dp x cp x attn_tp, dp-major."""
    attn_tp = tp // (attn_dp * attn_cp)
    coords = {}
    for p, d, c, a in itertools.product(range(pp), range(attn_dp), range(attn_cp), range(attn_tp)):
        coords[p * tp + (d * attn_cp + c) * attn_tp + a] = (p, d, c, a)
    assert sorted(coords) == list(range(world))

    def members(rank, same):  # ranks sharing the coordinates in ``same``, in rank order
        return tuple(r for r in sorted(coords)
                     if all(coords[r][i] == coords[rank][i] for i in same))

    expected = {}
    for r, (_p, d, c, a) in coords.items():
        groups = {"tp": members(r, (0,)), "attn_tp": members(r, (0, 1, 2)),
                  "attn_dp": members(r, (0, 2, 3)), "pp": members(r, (1, 2, 3))}
        expected[r] = {
            "rank": r,
            "tp_rank": (d * attn_cp + c) * attn_tp + a,
            "attn_tp_rank": a,
            "attn_dp_rank": d,
            "groups": {name: (ranks, ranks.index(r), len(ranks), float(sum(2 ** q for q in ranks)),
                              len(ranks) == 1)
                       for name, ranks in groups.items()},
        }
    return expected


LAYOUTS = [
    dict(tp=4),
    dict(tp=4, attn_dp=2),
    dict(tp=4, attn_dp=4),
    dict(tp=4, attn_cp=2),
    dict(tp=4, attn_dp=2, attn_cp=2),
    dict(tp=2, pp=2),
    dict(tp=2, pp=2, attn_dp=2),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kwargs", LAYOUTS,
                         ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_group_layout_on_4_ranks(kwargs):
    results = get_pool(4).run(_layout, kwargs)
    expected = _expected_layout(4, **kwargs)
    for r, got in enumerate(results):
        assert got == expected[r], f"rank {r}"


# ------------------------------------------------------------------ release


def _gloo_threads() -> int:
    """This process's gloo I/O threads: one for each live gloo group."""
    gc.collect()
    tasks = Path(f"/proc/{os.getpid()}/task")
    return sum((t / "comm").read_text().strip() == "gloo_tcp_loop" for t in tasks.iterdir())


def _release_and_rebuild() -> dict:
    dp2, tp4 = ParallelDims(world_size=4, tp=4, attn_dp=2), ParallelDims(world_size=4, tp=4)
    for dims in built_topologies():  # whatever earlier cases left (all ranks hold the same)
        release_parallel(dims)
    a = build_parallel(dp2)
    b = build_parallel(tp4)
    out = {"same_key": a.tp_group.key == b.tp_group.key,
           "key_is_latest": process_group(b.tp_group.key) is b.tp_group.pg,
           "hit_is_same": build_parallel(dp2) is a,
           "order": built_topologies() == (tp4, dp2)}  # the hit made dp2 the most recent
    b_groups = sum(g.pg is not None for g in b.groups())
    threads = _gloo_threads()
    del b
    release_parallel(tp4)
    release_parallel(tp4)  # no longer built: nothing happens
    out["threads_ended"] = threads - _gloo_threads() == b_groups
    out["kept"] = built_topologies() == (dp2,)
    out["key_back"] = process_group(a.tp_group.key) is a.tp_group.pg
    with pytest.raises(KeyError):  # a group only the released topology held
        process_group("attn_tp:0,1,2,3")
    sums = []
    for par in (a, build_parallel(tp4)):  # the kept groups still sum, and rebuilt ones too
        t = torch.ones(1)
        dist.all_reduce(t, group=par.tp_group.pg)
        sums.append(int(t))
    out["sums"] = sums
    for dims in (dp2, tp4):
        release_parallel(dims)
    return out


@pytest.mark.timeout(120)
def test_release_parallel_ends_a_topologys_groups_and_keeps_the_rest():
    for got in get_pool(4).run(_release_and_rebuild):
        assert got == {"same_key": True, "key_is_latest": True, "hit_is_same": True,
                       "order": True, "threads_ended": True, "kept": True, "key_back": True,
                       "sums": [4, 4]}, got
