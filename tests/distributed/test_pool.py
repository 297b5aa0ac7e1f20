"""Tests of the rank pool itself, on real gloo collectives over loopback."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from .pool import RankFailure, RankTimeout, get_pool

# Case functions live at module level: workers import this module to find them.


def _all_reduce_rank_tensor(n):
    t = torch.arange(n, dtype=torch.float64) + 10.0 * dist.get_rank()
    dist.all_reduce(t)
    return t


def _whoami(tag, *, scale):
    return dist.get_rank(), dist.get_world_size(), tag, scale * dist.get_rank(), os.getpid()


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    t = torch.ones(1)
    dist.all_reduce(t)  # the other ranks now wait on rank 1, which never comes
    return t


def _raise_everywhere():
    raise KeyError(f"no key on rank {dist.get_rank()}")


def _sleep_on_rank_1(seconds):
    if dist.get_rank() == 1:
        time.sleep(seconds)
    return dist.get_rank()


def _exit_on_rank_0():
    if dist.get_rank() == 0:
        os._exit(3)
    return dist.get_rank()


def _pid():
    return os.getpid()


def _check_all_reduce(world_size):
    n = 5
    results = get_pool(world_size).run(_all_reduce_rank_tensor, n)
    # sum over ranks r of (arange(n) + 10 r)
    expected = world_size * torch.arange(n, dtype=torch.float64) + 10.0 * sum(range(world_size))
    assert len(results) == world_size
    for got in results:
        assert got.dtype == torch.float64
        assert torch.equal(got, expected)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_sums_over_ranks(world_size):
    _check_all_reduce(world_size)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_results_in_rank_order_with_args(world_size):
    results = get_pool(world_size).run(_whoami, "t", scale=7)
    assert [r[:4] for r in results] == [(r, world_size, "t", 7 * r) for r in range(world_size)]
    assert len({r[4] for r in results}) == world_size  # one process per rank


@pytest.mark.timeout(120)
def test_pool_and_workers_are_reused():
    pool = get_pool(2)
    assert get_pool(2) is pool
    first = pool.run(_pid)
    second = pool.run(_pid)
    assert first == second
    assert len(set(first)) == 2
    assert os.getpid() not in first


@pytest.mark.timeout(120)
def test_rank_exception_becomes_rank_failure_and_pool_recovers():
    pool = get_pool(2)
    before = pool.run(_pid)
    with pytest.raises(RankFailure) as info:
        pool.run(_raise_on_rank_1)
    message = str(info.value)
    # the pool's grace after the first failure ended the wait: rank 0, stuck in a collective
    # that gloo fails only after its 60 s timeout, was killed unheard (waited for, it would
    # have reported that timeout instead)
    assert "rank(s) [0] did not report (killed)" in message, message
    assert "boom on rank 1" in message
    assert "rank 1" in message
    assert "ValueError" in message
    assert "_raise_on_rank_1" in message  # the remote traceback, not just the text
    assert get_pool(2) is pool
    after = pool.run(_pid)
    assert set(after).isdisjoint(before)  # rank 0 was stuck, so the pool restarted
    _check_all_reduce(2)


@pytest.mark.timeout(120)
def test_failure_on_every_rank_keeps_the_pool():
    pool = get_pool(2)
    before = pool.run(_pid)
    with pytest.raises(RankFailure) as info:
        pool.run(_raise_everywhere)
    message = str(info.value)
    assert "no key on rank 0" in message and "no key on rank 1" in message
    assert pool.run(_pid) == before


@pytest.mark.timeout(120)
def test_timeout_raises_quickly_and_pool_recovers():
    pool = get_pool(2)
    before = pool.run(_pid)
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:  # a timeout not kept: rank 1 returns, no raise
        pool.run(_sleep_on_rank_1, 60, timeout=3)
    assert time.monotonic() - start >= 3  # it did wait that long (a busy machine waits more)
    assert "did not answer within 3 s" in str(info.value)
    assert "[1]" in str(info.value)
    assert "[0]" not in str(info.value)
    assert set(pool.run(_pid)).isdisjoint(before)
    assert pool.run(_sleep_on_rank_1, 0.1, timeout=30) == [0, 1]


@pytest.mark.timeout(120)
def test_dead_rank_becomes_rank_failure_and_pool_recovers():
    pool = get_pool(2)
    with pytest.raises(RankFailure) as info:  # a death not seen: RankTimeout at the guard
        pool.run(_exit_on_rank_0, timeout=60)
    assert "rank 0" in str(info.value)
    assert "exit code 3" in str(info.value)
    _check_all_reduce(2)


@pytest.mark.timeout(30)
def test_unpicklable_fn_is_rejected_before_sending():
    with pytest.raises(TypeError, match="module level"):
        get_pool(2).run(lambda: 0)


ORPHAN_CASE = '''
import os, time
from distributed.pool import get_pool

def _write_pid_and_sleep(folder):
    with open(os.path.join(folder, str(os.getpid())), "w"):
        pass
    time.sleep(120)

def test_long_case():
    get_pool(2).run(_write_pid_and_sleep, {folder!r}, timeout=300)
'''


@pytest.mark.timeout(300)
def test_sigterm_to_pytest_leaves_no_worker_behind(tmp_path):
    """A CI timeout sends SIGTERM to pytest, which then runs none of its cleanup: the workers,
    busy in a case, end by themselves once their parent is gone."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent.parent
    pids = tmp_path / "pids"
    pids.mkdir()
    case = tmp_path / "test_orphans.py"
    case.write_text(ORPHAN_CASE.format(folder=str(pids)))
    env = {**os.environ, "PYTHONPATH": str(tests) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-p", "no:randomly", str(case)], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240  # a hang guard: start-up takes what the machine takes
    while len(list(pids.iterdir())) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.2)
    workers = [int(p.name) for p in pids.iterdir()]
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived pytest"
        time.sleep(0.2)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False
