"""The command line's own spawner: results by value, bad input re-raised as itself, the
spawner's environment in every rank, whichever way the ranks start."""

from __future__ import annotations

import os
import re

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


TORCHRUN = {"TORCHELASTIC_RUN_ID": "job", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("changes,message", [
    ({"RANK": None}, "RANK is not set"),
    ({"RANK": "abc"}, "RANK='abc' must be an integer of at least 0"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be an integer of at least 1"),
    ({"RANK": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"LOCAL_RANK": None}, "LOCAL_RANK is not set"),
    ({"LOCAL_WORLD_SIZE": "two"}, "LOCAL_WORLD_SIZE='two' must be an integer of at least 1"),
    ({"LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE=4 exceeds WORLD_SIZE=2"),
    ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
    ({"MASTER_PORT": None}, "MASTER_PORT is not set"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT='70000' must be a port number, 1 to 65535"),
    # a hand-made env:// launch (no TORCHELASTIC_RUN_ID) may leave LOCAL_* out, not the port
    ({"TORCHELASTIC_RUN_ID": None, "LOCAL_RANK": None, "LOCAL_WORLD_SIZE": None,
      "MASTER_PORT": None}, "MASTER_PORT is not set"),
], ids=lambda v: str(v) if isinstance(v, str) else None)
def test_torchruns_environment_is_checked_variable_by_variable(monkeypatch, changes, message):
    """TORCHELASTIC_RUN_ID without RANK was a KeyError traceback, RANK=abc an int() error
    naming no variable: each missing or malformed variable is named, as a ValueError the
    command line prints as one line, before any rendezvous."""
    from layer_boundary.runtime.launch import (LaunchEnvironmentError, init_distributed,
                                               launched_by_torchrun)

    for name, value in {**TORCHRUN, **changes}.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    for call in (launched_by_torchrun, init_distributed):
        with pytest.raises(LaunchEnvironmentError, match="^" + re.escape(message)):
            call()
    assert not dist.is_initialized()


def test_a_complete_torchrun_environment_is_read_and_none_is_not_torchrun(monkeypatch):
    from layer_boundary.runtime.launch import launched_by_torchrun, torchrun_environment

    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert launched_by_torchrun() and torchrun_environment() == {
        "RANK": 1, "WORLD_SIZE": 2, "LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 2,
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}
    for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR"):
        monkeypatch.delenv(name)
    assert not launched_by_torchrun()  # RANK and WORLD_SIZE alone: some other launcher's


@pytest.mark.parametrize("call,message", [
    (lambda: spawn(_sum_of_ranks, 0), r"spawn\(world_size=0\): world_size must be at least 1"),
    (lambda: spawn(_sum_of_ranks, "2"), r"spawn\(world_size='2'\): world_size must be an "
                                        "integer"),
    (lambda: spawn(_sum_of_ranks, 2, timeout_s=float("nan")),
     r"spawn\(timeout_s=nan\): timeout_s must be a positive, finite number"),
    (lambda: spawn("fn", 2), r"spawn\(fn='fn'\): fn must be a module-level function"),
], ids=["world-0", "world-str", "timeout-nan", "fn"])
def test_spawns_arguments_are_named_before_any_rank_starts(call, message):
    """world_size 0 returned no results and ran nothing; a string world or a NaN timeout
    ended in raw Python errors."""
    with pytest.raises((TypeError, ValueError), match="^" + message):
        call()


@pytest.mark.parametrize("kwargs,message", [
    ({"rank": -1, "world_size": 2, "init_method": "tcp://127.0.0.1:1"},
     r"init_distributed\(rank=-1\): rank must be an integer from 0 to world_size - 1 = 1"),
    ({"rank": 0, "world_size": 2}, r"init_distributed\(init_method=None\): give the "
                                   "rendezvous URL"),
    ({"world_size": 2}, "init_distributed: world_size and init_method go with rank"),
    ({"rank": 0, "world_size": 1, "init_method": "tcp://127.0.0.1:1",
      "timeout_s": float("inf")}, r"init_distributed\(timeout_s=inf\)"),
], ids=["rank", "no-url", "world-without-rank", "timeout-inf"])
def test_init_distributeds_arguments_are_named_before_any_rendezvous(kwargs, message):
    """A negative rank joined a rendezvous that never completes; the others ended in
    torch's or timedelta's errors."""
    from layer_boundary.runtime.launch import init_distributed

    with pytest.raises((TypeError, ValueError), match="^" + message):
        init_distributed(**kwargs)
    assert not dist.is_initialized()
