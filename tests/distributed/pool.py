"""A reusable pool of rank processes for multi-rank tests on real gloo collectives.

Starting a process per test case costs seconds of imports on a small machine, so
one pool per world size is started on first use and shared by the whole session.

Each worker joins a gloo process group over 127.0.0.1 once at start, then runs
cases sent by the parent: ``get_pool(2).run(fn, *args, **kwargs)`` calls
``fn(*args, **kwargs)`` on every rank and returns the results in rank order.
``fn`` must be importable by reference (a module-level function in a module the
workers can import); args and results travel by plain pickling, so tensors come
back as full copies.
"""

from __future__ import annotations

import atexit
import datetime
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from layer_boundary.runtime.launch import free_port, process_state

# Once one rank has failed, the others are probably stuck in a collective that
# will only error after the 60 s gloo timeout; this is how long they get to
# report anyway before the pool is torn down.
_GRACE_S = 3.0
_JOIN_S = 10.0
_GLOO_TIMEOUT = datetime.timedelta(seconds=60)
_STOP = b"stop"  # never a valid pickle, so it cannot be mistaken for a task


class RankFailure(RuntimeError):
    """One or more ranks raised or died; the message holds their tracebacks."""


class RankTimeout(RuntimeError):
    """A case did not finish in time; the pool was killed and will restart."""


# what the fork server imports before its first fork (the launcher's own list, and what the
# test modules' cases import on every rank: the engine, transformers' configs, and torch's
# compiler for the compiled cases)
PRELOAD = ["torch", "torch.distributed", "layer_boundary.runtime.launch",
           "layer_boundary.engine.runner", "transformers", "torch._dynamo", "distributed.pool"]


def _child_env() -> dict[str, str]:
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    # Gloo otherwise picks the interface the hostname resolves to, which in
    # containers may be an address the ranks cannot reach each other on.
    if "GLOO_SOCKET_IFNAME" not in os.environ and any(
        name == "lo" for _, name in socket.if_nameindex()
    ):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def _end_with(parent: int) -> None:
    """A worker's daemon thread: exit as soon as the parent (the test process, not the fork
    server the worker comes from) is gone, whatever ended it (a SIGTERM or SIGKILL runs none
    of its cleanup), even in the middle of a case."""
    while process_state(parent) not in (None, "Z", "X"):  # gone, or a zombie
        time.sleep(0.5)
    os._exit(1)


def _worker(rank: int, world_size: int, port: int, sys_path: list[str], conn,
            parent: int, env: dict[str, str]) -> None:
    import threading

    threading.Thread(target=_end_with, args=(parent,), daemon=True).start()
    # a forked worker holds the fork server's environment: the settings gloo reads at
    # init_process_group come from here (torch's thread count is set below)
    os.environ.update(env)
    sys.path[:] = sys_path  # so the test module that defines fn imports here
    # Ctrl-C reaches the whole process group; the parent does the cleanup.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=_GLOO_TIMEOUT,
        )
    except BaseException:
        conn.send_bytes(pickle.dumps(("err", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    try:
        while True:
            try:
                task = conn.recv_bytes()
            except EOFError:  # the parent has gone away
                break
            if task == _STOP:
                break
            try:
                fn, args, kwargs = pickle.loads(task)
                reply = pickle.dumps(("ok", fn(*args, **kwargs)))
            except BaseException:  # SystemExit from fn must not end the worker silently
                reply = pickle.dumps(("err", traceback.format_exc()))
            conn.send_bytes(reply)
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world_size`` worker processes sharing one gloo process group.

    Processes start on the first ``run`` and again on the next ``run`` after a
    failure or timeout tore them down; the object itself stays the same.
    """

    # start-up (importing torch in every worker) takes what a loaded machine gives it
    def __init__(self, world_size: int, *, start_timeout: float = 300.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.start_timeout = start_timeout
        self.port: int | None = None
        self._procs: list = []
        self._conns: list = []

    def _alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _start(self) -> None:
        """Start the workers; a rendezvous that fails (gloo's loopback mesh, rarely, on a
        loaded machine) is tried once more on a fresh port."""
        try:
            self._start_once()
        except RankFailure:
            self._start_once()

    def _start_once(self) -> None:
        # workers (and the ranks a command run in this process spawns: one fork server per
        # process, whoever starts it first sets what it imports) fork from a server that
        # imported torch, the package and its engine once: a rank that imports them itself
        # spends seconds of CPU on it (torch's compiler, which the package's construction
        # imports, the most), and a pool that restarts after a failed case starts in a
        # fraction of a second
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self.port = free_port()
        env = _child_env()
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, self.world_size, self.port, list(sys.path), child_conn,
                      os.getpid(), env),
                name=f"RankPool-{self.world_size}-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()  # so a dead child shows up as EOF here
            self._procs.append(proc)
            self._conns.append(parent_conn)
        replies, pending = self._collect(time.monotonic() + self.start_timeout)
        failures = {r: msg for r, (kind, msg) in replies.items() if kind != "ready"}
        if failures or pending:
            self._kill()
            raise RankFailure(
                f"could not start a pool of {self.world_size} ranks on port {self.port}"
                + _describe(failures, pending)
            )

    def _receive(self, rank: int) -> tuple[str, object]:
        conn, proc = self._conns[rank], self._procs[rank]
        try:
            if conn.poll(0):
                return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            pass
        except Exception:  # the result cannot be unpickled in this process
            return ("err", f"could not unpickle the reply:\n{traceback.format_exc()}")
        proc.join(1.0)
        return ("err", f"rank process died (exit code {proc.exitcode})")

    def _collect(self, deadline: float) -> tuple[dict[int, tuple[str, object]], set[int]]:
        """Wait for one reply per rank until ``deadline`` (shortened once one fails)."""
        replies: dict[int, tuple[str, object]] = {}
        pending = set(range(self.world_size))
        failed = False
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            handles = {}
            for r in pending:
                handles[self._conns[r]] = r
                handles[self._procs[r].sentinel] = r
            ready = wait(list(handles), timeout=remaining)
            for r in sorted({handles[h] for h in ready}):
                replies[r] = self._receive(r)
                pending.discard(r)
                if replies[r][0] == "err" and not failed:
                    failed = True
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
        return replies, pending

    def run(self, fn, *args, timeout: float = 120.0, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return results in rank order."""
        try:
            task = pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(
                "fn and its arguments must pickle; define fn at module level "
                "in an importable module"
            ) from exc
        if not self._alive():
            self._kill()
            self._start()
        for conn in self._conns:
            try:
                conn.send_bytes(task)
            except OSError:  # a dead rank is reported by _collect
                pass
        replies, pending = self._collect(time.monotonic() + timeout)
        failures = {r: msg for r, (kind, msg) in replies.items() if kind == "err"}
        if failures:
            if pending:  # stuck ranks: only a restart gets the group usable again
                self._kill()
            raise RankFailure(
                f"{fn.__qualname__} failed on {self.world_size} ranks"
                + _describe(failures, pending)
            )
        if pending:
            self._kill()
            raise RankTimeout(
                f"{fn.__qualname__}: rank(s) {sorted(pending)} of {self.world_size} "
                f"did not answer within {timeout} s; the pool will restart on next use"
            )
        return [replies[r][1] for r in range(self.world_size)]

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(_JOIN_S)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def close(self) -> None:
        """Ask the workers to leave the group and exit; kill whatever remains."""
        for conn in self._conns:
            try:
                conn.send_bytes(_STOP)
            except OSError:
                pass
        deadline = time.monotonic() + _JOIN_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()


def _describe(failures: dict[int, object], pending: set[int]) -> str:
    parts = [f"\n--- rank {r} ---\n{failures[r]}" for r in sorted(failures)]
    if pending:
        parts.append(f"\nrank(s) {sorted(pending)} did not report (killed)")
    return "".join(parts)


_pools: dict[int, RankPool] = {}


def get_pool(world_size: int) -> RankPool:
    """The shared pool for ``world_size``; its processes restart if they died."""
    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = RankPool(world_size)
    return pool


def close_all_pools() -> None:
    """End every pool's workers at once. A graceful exit costs each worker its process
    group's teardown and interpreter shutdown (seconds per pool, pools one after another);
    at the end of a session nothing is left to say to them, so they are killed."""
    while _pools:
        _, pool = _pools.popitem()
        pool._kill()


atexit.register(close_all_pools)
