"""The command line's own spawner: results by value, bad input re-raised as itself."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from layer_boundary.runtime.launch import RankError, spawn


def _sum_of_ranks():
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    return x


def _bad_input_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("config.json field hidden_size is wrong")
    return 0


def _crash_on_rank_0():
    if dist.get_rank() == 0:
        raise KeyError("boom")
    return 0


@pytest.mark.timeout(120)
def test_spawn_returns_tensors_by_value_in_rank_order():
    results = spawn(_sum_of_ranks, 2)
    assert [r.item() for r in results] == [3.0, 3.0]


@pytest.mark.timeout(120)
def test_spawn_reraises_a_ranks_value_error_unwrapped():
    with pytest.raises(ValueError, match="^config.json field hidden_size is wrong$"):
        spawn(_bad_input_on_rank_1, 2)


@pytest.mark.timeout(120)
def test_spawn_wraps_other_failures_with_the_rank_traceback():
    with pytest.raises(RankError, match="rank 0: KeyError"):
        spawn(_crash_on_rank_0, 2)
