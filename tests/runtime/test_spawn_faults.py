"""Faults of real rank processes: a rank that dies or stops ends the job within a minute with
an error naming it, and no rank outlives the job or its parent (killed or terminated)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from layer_boundary.runtime.parallel import RankError, spawn

REPO = Path(__file__).resolve().parent.parent.parent


def _dies_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()  # waits for the dead rank
    return 0


def _killed_on_rank_1():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return 0


def _stops_on_rank_1():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.barrier()
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (reaped later by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
def test_a_rank_that_dies_ends_the_job_naming_it():
    start = time.monotonic()
    with pytest.raises(RankError, match="^rank 1 exited with code 3 before reporting"):
        spawn(_dies_on_rank_1, 2)
    assert time.monotonic() - start < 60


@pytest.mark.timeout(120)
def test_a_killed_rank_ends_the_job_naming_it():
    with pytest.raises(RankError, match="^rank 1 was killed \\(signal 9\\) before reporting"):
        spawn(_killed_on_rank_1, 2)


@pytest.mark.timeout(120)
def test_a_stopped_rank_ends_the_job_naming_it():
    start = time.monotonic()
    with pytest.raises(RankError, match="^rank 1 stopped responding"):
        spawn(_stops_on_rank_1, 2, silent_s=8)
    assert time.monotonic() - start < 60


PARENT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from runtime.test_spawn_faults import _report_and_sleep
    from layer_boundary.runtime.parallel import spawn
    spawn(_report_and_sleep, 2, {pids!r})
""")


def _report_and_sleep(pids: str):
    with open(f"{pids}.{dist.get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_ranks_end_with_their_parent(tmp_path, how):
    pids = str(tmp_path / "pid")
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(tests=str(REPO / "tests"), pids=pids)], cwd=REPO)
    deadline = time.monotonic() + 90
    while not all(Path(f"{pids}.{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and parent.poll() is None, "ranks did not start"
        time.sleep(0.2)
    ranks = [int(Path(f"{pids}.{r}").read_text()) for r in range(2)]
    parent.send_signal(how)
    parent.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in ranks):
        assert time.monotonic() < deadline, f"ranks {ranks} outlived their parent"
        time.sleep(0.2)


@pytest.mark.timeout(180)
def test_a_stopped_rank_under_torchrun_ends_the_job(tmp_path):
    """Under torchrun no spawner watches the ranks: the collective timeout (15 s there) fails
    the peer, torchrun stops the group, stopped rank included, within a minute."""
    pids = str(tmp_path / "pid")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), str(REPO / "tests/runtime/torchrun_stopped_rank.py")],
        cwd=REPO, env={**os.environ, "PIDS": pids}, capture_output=True, text=True, timeout=150)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    ranks = [int(Path(f"{pids}.{r}").read_text()) for r in range(2)]
    assert not any(_alive(pid) for pid in ranks)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
