"""The command line's own spawner: results by value, bad input re-raised as itself, the
spawner's environment in every rank, whichever way the ranks start."""

from __future__ import annotations

import os

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


def _environment(name):
    return os.environ.get(name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_spawn_returns_tensors_by_value_in_rank_order(start_method):
    results = spawn(_sum_of_ranks, 2, start_method=start_method)
    assert [r.item() for r in results] == [3.0, 3.0]


@pytest.mark.timeout(120)
def test_forked_ranks_see_the_spawners_environment_now(monkeypatch):
    """The fork server keeps the environment it started with; each rank takes the
    spawner's, as a spawned interpreter would."""
    spawn(_sum_of_ranks, 2)  # the server runs from here on
    monkeypatch.setenv("LB_TEST_SPAWN_ENV", "later")
    assert spawn(_environment, 2, "LB_TEST_SPAWN_ENV") == ["later", "later"]


def test_an_unknown_start_method_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="^start_method must be 'forkserver' or 'spawn', "
                                         "not 'fork'$"):
        spawn(_sum_of_ranks, 2, start_method="fork")


@pytest.mark.timeout(120)
def test_spawn_reraises_a_ranks_value_error_unwrapped():
    with pytest.raises(ValueError, match="^config.json field hidden_size is wrong$"):
        spawn(_bad_input_on_rank_1, 2)


@pytest.mark.timeout(120)
def test_spawn_wraps_other_failures_with_the_rank_traceback():
    with pytest.raises(RankError, match="rank 0: KeyError"):
        spawn(_crash_on_rank_0, 2)
