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

from layer_boundary.runtime.launch import HEARTBEAT_S, SILENT_S, RankError, free_port, spawn

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


def _stops_on_rank_1(stamp: str):
    """Rank 1 writes when it stops (after its heartbeats began), then stops itself."""
    if dist.get_rank() == 1:
        time.sleep(2 * HEARTBEAT_S)  # heartbeats have gone out
        Path(stamp).write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.barrier()
    return 0


def _ended_within(stamp: Path, bound: float) -> None:
    """The job ended within ``bound`` s of the moment the rank stopped (not of the spawn:
    start-up on a loaded machine is not what the detection window bounds)."""
    assert time.time() - float(stamp.read_text()) < bound


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
    # rank 0's barrier waits beyond this test's timeout: only the spawner's watch ends the job
    with pytest.raises(RankError, match="^rank 1 exited with code 3 before reporting"):
        spawn(_dies_on_rank_1, 2, collective_timeout_s=3600)


@pytest.mark.timeout(120)
def test_a_killed_rank_ends_the_job_naming_it():
    with pytest.raises(RankError, match="^rank 1 was killed \\(signal 9\\) before reporting"):
        spawn(_killed_on_rank_1, 2)


@pytest.mark.timeout(300)
def test_a_stopped_rank_ends_the_job_naming_it(tmp_path):
    """The OS reports the process stopped: the job ends within STOPPED_S (plus polling)."""
    stamp = tmp_path / "stopped"
    with pytest.raises(RankError, match="^rank 1 stopped responding \\(its process is stopped, "
                                        "state T\\)"):
        spawn(_stops_on_rank_1, 2, str(stamp))
    _ended_within(stamp, 60)


PARENT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from runtime.test_spawn_faults import _report_and_sleep
    from layer_boundary.runtime.launch import spawn
    spawn(_report_and_sleep, 2, {pids!r}, os.getpid())
""")


def _report_and_sleep(pids: str, parent: int):
    """Says it started, then returns once ``parent`` (the spawner) is gone: its result then
    meets a closed pipe, which is no reason to print a traceback."""
    with open(f"{pids}.{dist.get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 600
    while _alive(parent) and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_ranks_end_with_their_parent(tmp_path, how):
    pids = str(tmp_path / "pid")
    err = tmp_path / "stderr"  # the parent's, which its ranks inherit
    with open(err, "w") as stderr:
        parent = subprocess.Popen(
            [sys.executable, "-c", PARENT.format(tests=str(REPO / "tests"), pids=pids)],
            cwd=REPO, stderr=stderr)
    deadline = time.monotonic() + 240  # a hang guard: start-up takes what the machine takes
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
    # a rank whose result met the closed pipe printed a BrokenPipeError traceback
    assert "Traceback" not in err.read_text(), err.read_text()


@pytest.mark.timeout(300)
def test_a_stopped_rank_under_torchrun_ends_the_job(tmp_path):
    """Under torchrun no spawner watches the ranks: the collective timeout (15 s there) fails
    the peer, then torchrun stops the group, stopped rank included (after its own grace
    period for a rank that does not answer SIGTERM), leaving no process. What this package
    controls is the detection: the peer gives up within the collective timeout of the stop."""
    from layer_boundary.engine.run_command import TORCHRUN_COLLECTIVE_TIMEOUT_S

    pids = str(tmp_path / "pid")
    for _ in range(3):  # a free port can be taken before torchrun binds it (a parallel suite)
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(free_port()),
             str(REPO / "tests/runtime/torchrun_stopped_rank.py")],
            cwd=REPO, env={**os.environ, "PIDS": pids}, capture_output=True, text=True,
            timeout=240)
        if Path(f"{pids}.stopped").exists() or "address already in use" not in (
                proc.stdout + proc.stderr).lower():
            break
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert Path(f"{pids}.stopped").exists(), ("rank 1 never reached its stop:\n"
                                              + proc.stdout + proc.stderr)
    stopped, gave_up = (float(Path(f"{pids}.{what}").read_text())
                        for what in ("stopped", "gave_up"))
    # the gloo timer fires on time; a loaded machine delays only the report of it
    window = TORCHRUN_COLLECTIVE_TIMEOUT_S
    assert window - 1 < gave_up - stopped < window + 30
    ranks = [int(Path(f"{pids}.{r}").read_text()) for r in range(2)]
    assert not any(_alive(pid) for pid in ranks)




# ------------------------------------------------------------ start-up is not silence

DELAY = textwrap.dedent("""
    # Delays (or stops) every rank process the spawner starts, before the rank runs anything:
    # what a loaded machine or a network filesystem does to start-up. A spawned rank is a
    # fresh interpreter; a forked one leaves the fork server through _serve_one.
    import os, signal, sys, time

    def _late():
        if os.environ.get("LB_TEST_START_STOP"):
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(float(os.environ.get("LB_TEST_START_DELAY", "0")))

    if "--multiprocessing-fork" in sys.argv:
        _late()
    elif "LB_TEST_START_DELAY" in os.environ:
        import multiprocessing.forkserver as _fs
        _serve_one = _fs._serve_one

        def _late_serve_one(*args):
            _late()
            return _serve_one(*args)
        _fs._serve_one = _late_serve_one
""")


def _restart_fork_server() -> None:
    """The next job starts a fork server of its own, with this process's environment now.
    The server lives until the last process it forked has exited (each holds its "alive"
    pipe): the rank pools' workers, forked by the same server where this file runs beside
    the pool's tests in one pytest, are stopped first, or stopping it waits forever."""
    from multiprocessing import forkserver

    from distributed.pool import close_all_pools

    close_all_pools()
    forkserver._forkserver._stop()


@pytest.fixture
def late_start(tmp_path, monkeypatch):
    """Rank processes started from here begin ``delay`` seconds late (a sitecustomize on
    their PYTHONPATH, and on the fork server's; this process has imported everything
    already)."""
    (tmp_path / "sitecustomize.py").write_text(DELAY)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + (os.pathsep + path if path else ""))

    def delay(seconds: float, stop: bool = False) -> None:
        monkeypatch.setenv("LB_TEST_START_DELAY", str(seconds))
        if stop:
            monkeypatch.setenv("LB_TEST_START_STOP", "1")
        _restart_fork_server()
    yield delay
    _restart_fork_server()  # the next test's ranks start on time


@pytest.mark.timeout(120)
def test_ranks_that_start_late_are_not_silent(late_start):
    """Silence counts from a rank's first heartbeat: ranks 10 s late pass a 6 s window."""
    late_start(10)
    start = time.monotonic()
    assert spawn(_rank, 2, silent_s=6) == [0, 1]
    assert time.monotonic() - start >= 10  # the delay really happened


@pytest.mark.timeout(120)
def test_a_rank_that_does_not_start_in_time_is_named(late_start):
    late_start(60)
    with pytest.raises(RankError, match="^rank 0 did not start within 5 s; the job was "
                                        "stopped$"):
        spawn(_rank, 2, start_timeout_s=5)


@pytest.mark.timeout(120)
def test_a_rank_stopped_while_starting_ends_the_job(late_start):
    """Stopped before its first heartbeat: the OS says so, well inside the start window (the
    start timeout, beyond this test's, would name it "did not start")."""
    late_start(0, stop=True)
    with pytest.raises(RankError, match="^rank 0 stopped responding \\(its process is "
                                        "stopped, state T\\)"):
        spawn(_rank, 2)


@pytest.mark.timeout(300)
def test_a_stopped_rank_is_found_by_its_silence_where_the_os_cannot_say(monkeypatch, tmp_path):
    """Without the OS's word, silence after its heartbeats began: within silent_s, and within
    60 s of the stop at the default window."""
    from layer_boundary.runtime import launch

    monkeypatch.setattr(launch, "process_state", lambda pid: None)
    stamp = tmp_path / "stopped"
    with pytest.raises(RankError, match="^rank 1 stopped responding \\(no heartbeat for 8 s\\)"):
        spawn(_stops_on_rank_1, 2, str(stamp), silent_s=8)
    _ended_within(stamp, 60)
    assert SILENT_S + HEARTBEAT_S < 60


def _rank():
    return dist.get_rank()


@pytest.mark.timeout(240)
def test_run_passes_with_every_rank_starting_30_s_late(late_start, capsys, restore_logger):
    """`layer-boundary run --tp 2` on the built-in checkpoint, each rank 30 s late (more than
    the 20 s silence window)."""
    from layer_boundary.engine.cli import main

    late_start(30)
    code = main(["run", "--tp", "2", "--max-new-tokens", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert "parity vs world 1: PASS" in captured.out


@pytest.mark.timeout(300)
def test_a_failed_rendezvous_starts_the_job_once_more(monkeypatch):
    """The first port is taken (what gloo's loopback mesh sometimes does to itself on a
    loaded machine): no rank ran anything, so the job starts again on a fresh port."""
    import socket

    from layer_boundary.runtime import launch

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: next(ports, None) or real())
    try:
        assert spawn(_rank, 2) == [0, 1]
    finally:
        taken.close()


SIGINT_AT_START = textwrap.dedent("""
    # Records how the fork server's interpreter takes Ctrl-C as it starts: it imports torch
    # (a second or more) before multiprocessing makes it ignore Ctrl-C itself.
    import os, signal

    if b"forkserver" in open("/proc/self/cmdline", "rb").read():
        with open(os.environ["LB_TEST_SIGINT_FILE"], "a") as f:
            taken = signal.getsignal(signal.SIGINT)
            f.write(("ignored" if taken == signal.SIG_IGN else repr(taken)) + "\\n")
""")


@pytest.mark.timeout(120)
def test_the_fork_server_starts_with_ctrl_c_ignored(tmp_path, monkeypatch):
    """A Ctrl-C (the terminal's SIGINT to the whole process group) while the fork server
    imported torch printed the server's KeyboardInterrupt traceback (a traceback in 1 of 24
    runs stopped about 2 s in, as ``run --tp 4`` starts its ranks)."""
    (tmp_path / "sitecustomize.py").write_text(SIGINT_AT_START)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + (os.pathsep + path if path else ""))
    record = tmp_path / "sigint"
    monkeypatch.setenv("LB_TEST_SIGINT_FILE", str(record))
    # this process's own (the test script runs this file's pytest in the background, where
    # the shell has already made it ignore Ctrl-C)
    before = signal.getsignal(signal.SIGINT)
    _restart_fork_server()
    try:
        assert spawn(_rank, 1) == [0]
    finally:
        _restart_fork_server()  # the next test's server has this process's environment
    assert record.read_text() == "ignored\n"
    assert signal.getsignal(signal.SIGINT) is before  # ours, restored
