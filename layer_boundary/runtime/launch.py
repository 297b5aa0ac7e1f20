"""Process start-up: joining ranks (our spawner or torchrun's environment) and watching the
ranks we spawn, so a rank that dies, stops or falls silent ends the job with its reason.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import signal
import socket
import threading
import time
from multiprocessing import forkserver

import torch
import torch.distributed as dist

from .arguments import positive_int, positive_number

JOIN_TIMEOUT_S = 300.0  # the world group: rendezvous of ranks that start at different times
# how long a collective may wait for a peer before the job ends (an inference collective takes
# milliseconds; a silent peer is a stopped or dead rank): set by init_distributed
_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=45)


def collective_timeout() -> datetime.timedelta:
    """What bounds every collective of the groups built from now on."""
    return _COLLECTIVE_TIMEOUT



def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchEnvironmentError(ValueError):
    """torchrun's environment, incomplete or malformed: the message names the variable."""


# what torchrun sets in each worker's environment, and what each must hold
_TORCHRUN_COUNTS = (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1))
_MARKERS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")  # a hand-made env:// launch sets these


def launched_by_torchrun() -> bool:
    """Whether this process is a torchrun worker: its environment names the rendezvous
    (``TORCHELASTIC_RUN_ID``, or ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` as a hand-made
    env:// launch sets them). An environment that says so but is incomplete or malformed is a
    ``LaunchEnvironmentError`` naming the variable (``torchrun_environment``), not an answer
    either way."""
    if "TORCHELASTIC_RUN_ID" in os.environ or all(v in os.environ for v in _MARKERS):
        torchrun_environment()
        return True
    return False


def torchrun_environment() -> dict[str, int | str]:
    """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` as torchrun sets them, checked: each a one-line
    ``LaunchEnvironmentError`` naming the variable that is missing or not what it must be.
    Under torchrun (``TORCHELASTIC_RUN_ID``) all six must be set; a hand-made env:// launch
    may leave out the two ``LOCAL_*`` (the rank's device is then GPU 0, its host's ranks
    the world)."""
    env = os.environ
    by_torchrun = "TORCHELASTIC_RUN_ID" in env
    out: dict[str, int | str] = {}
    for name, least in _TORCHRUN_COUNTS:
        text = env.get(name)
        if text is None:
            if by_torchrun or not name.startswith("LOCAL_"):
                raise LaunchEnvironmentError(f"{name} is not set: a torchrun worker's "
                                             "environment names its rank, the world and "
                                             "the rendezvous (launch with torchrun)")
            continue
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise LaunchEnvironmentError(f"{name}={text!r} must be an integer of at least "
                                         f"{least} (torchrun sets it)")
        out[name] = value
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if rank in out and size in out and out[rank] >= out[size]:
            raise LaunchEnvironmentError(f"{rank}={out[rank]} is not below "
                                         f"{size}={out[size]}")
    if out.get("LOCAL_WORLD_SIZE", 1) > out["WORLD_SIZE"]:
        raise LaunchEnvironmentError(f"LOCAL_WORLD_SIZE={out['LOCAL_WORLD_SIZE']} exceeds "
                                     f"WORLD_SIZE={out['WORLD_SIZE']}")
    addr = env.get("MASTER_ADDR")
    if not addr or not addr.strip():
        raise LaunchEnvironmentError("MASTER_ADDR is not set: the rendezvous host (torchrun "
                                     "sets it)")
    port = env.get("MASTER_PORT")
    if port is None:
        raise LaunchEnvironmentError("MASTER_PORT is not set: the rendezvous port (torchrun "
                                     "sets it)")
    if not port.strip().isdigit() or not 1 <= int(port) <= 65535:
        raise LaunchEnvironmentError(f"MASTER_PORT={port!r} must be a port number, 1 to "
                                     "65535")
    out.update(MASTER_ADDR=addr, MASTER_PORT=int(port))
    return out


def _seconds(who: str, name: str, value) -> float:
    """A positive, finite number of seconds a timedelta holds."""
    value = positive_number(who, name, value)
    if value > datetime.timedelta.max.total_seconds():
        raise ValueError(f"{who}({name}={value!r}): {name} is beyond any wait")
    return value


def init_distributed(rank: int | None = None, world_size: int | None = None,
                     init_method: str | None = None, backend: str = "gloo",
                     timeout_s: float = 45.0,
                     join_timeout_s: float | None = None) -> tuple[int, int]:
    """Initialise torch.distributed once: from torchrun's environment or explicit arguments.

    Args:
        rank, world_size, init_method: explicit rendezvous (None: torchrun's environment).
        backend: the torch.distributed backend ("gloo" on CPU, "nccl" on GPUs).
        timeout_s: bounds every collective of the groups built later (every boundary
            collective runs on one): a peer silent that long (stopped, dead) ends the job
            instead of stalling it.
        join_timeout_s: how long joining the world may take (ranks still importing,
            loading); at least ``timeout_s``, default ``JOIN_TIMEOUT_S``.
    """
    global _COLLECTIVE_TIMEOUT
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    timeout_s = _seconds("init_distributed", "timeout_s", timeout_s)
    join = JOIN_TIMEOUT_S if join_timeout_s is None else _seconds(
        "init_distributed", "join_timeout_s", join_timeout_s)
    if rank is None:
        if world_size is not None or init_method is not None:
            raise ValueError("init_distributed: world_size and init_method go with rank (none "
                             "of them: torchrun's environment)")
        env = torchrun_environment()
        rank, world_size, init_method = env["RANK"], env["WORLD_SIZE"], "env://"
    else:
        world_size = positive_int("init_distributed", "world_size", world_size)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"init_distributed(rank={rank!r}): rank must be an integer from 0 "
                             f"to world_size - 1 = {world_size - 1}")
        if not isinstance(init_method, str) or not init_method:
            raise ValueError(f"init_distributed(init_method={init_method!r}): give the "
                             "rendezvous URL (tcp://host:port, env://, file://...)")
    _COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=max(timeout_s, join)))
    return rank, world_size


class RankError(RuntimeError):
    """A spawned rank failed; carries the first rank's exception when it can be re-raised."""


HEARTBEAT_S = 2.0  # a started rank reports it is alive this often
SILENT_S = 20.0  # a started rank silent this long (stuck, or stopped where the OS cannot say)
STOPPED_S = 3.0  # a rank whose process the OS reports stopped (SIGSTOP) this long ends the job
# Start-up is not silence: a rank imports torch and the package before it can report, which
# takes minutes on a loaded machine or a network filesystem.
from .defaults import START_TIMEOUT_S  # noqa: E402 - stated once, where --help reads it


def process_state(pid: int) -> str | None:
    """The process's state letter as the OS reports it ("T": stopped), None where it cannot."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # "pid (comm) state ...": comm may hold spaces and parentheses
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


class _Reporter:
    """A rank's channel to the spawner: heartbeats from a daemon thread, then its result; one
    lock, so a beat never interleaves with the result on the pipe."""

    def __init__(self, conn, parent: int) -> None:
        import threading

        self.conn, self.parent, self.lock = conn, parent, threading.Lock()
        threading.Thread(target=self._beat, daemon=True).start()

    def send(self, message) -> None:
        data = pickle.dumps(message)
        with self.lock:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the spawner is gone (killed): nobody to report to or print for
                os._exit(1)

    def _beat(self) -> None:
        # also the exit when the spawner is gone (whatever killed it): no rank outlives it
        while True:
            if os.getppid() != self.parent:
                os._exit(1)
            self.send(("beat", None))
            time.sleep(HEARTBEAT_S)


def _spawn_entry(rank, world_size, port, fn, args, conn, env, timeout_s, join_timeout_s,
                 backend):
    import traceback

    # a forked rank holds its server's environment: take the spawner's, as a spawned one would
    os.environ.clear()
    os.environ.update(env)
    os.environ["LOCAL_RANK"] = str(rank)  # one host: which device is this rank's
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # and how many ranks share its cores
    # Ctrl-C reaches every process of the terminal's foreground group: the spawner decides
    # what it means and stops the ranks itself, so a rank does not print its own traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the process that started this one (the spawner, or its fork server, which exits with it)
    reporter = _Reporter(conn, os.getppid())
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        init_distributed(rank, world_size, f"tcp://127.0.0.1:{port}", backend=backend,
                         timeout_s=timeout_s, join_timeout_s=join_timeout_s)
    except Exception as exc:  # nothing ran yet: the spawner may start the job again
        reporter.send(("rendezvous", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    try:
        # plain pickle copies tensors by value (a queue's pickler would share file descriptors
        # that vanish when this process exits)
        reporter.send(("ok", pickle.dumps(fn(*args))))
    except Exception as exc:  # report to the parent, which decides what the user sees
        try:
            payload = pickle.dumps(exc)
        except Exception:
            payload = None
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        reporter.send(("error", (payload, text)))
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args, timeout_s: float = 600.0,
          collective_timeout_s: float = 45.0, silent_s: float = SILENT_S,
          start_timeout_s: float = START_TIMEOUT_S, start_method: str = "forkserver",
          backend: str = "gloo") -> list:
    """Run ``fn(*args)`` on ``world_size`` local ranks; return per-rank results. Each rank
    has ``LOCAL_RANK`` (its rank) in its environment, as under torchrun.

    Args:
        fn: a module-level function (the ranks import it by reference).
        world_size: how many rank processes to start.
        timeout_s: how long the job may run once every rank has started.
        collective_timeout_s: how long a collective waits for a silent peer.
        silent_s: a started rank silent this long ends the job.
        start_timeout_s: how long a rank may take to start (import, join) before its first
            heartbeat; start-up is not silence.
        start_method: "forkserver" (default: ranks fork from one server per process that has
            imported torch and ``fn``'s module, so a job's ranks start in a fraction of a
            second instead of each importing torch again) or "spawn" (a fresh interpreter
            per rank).
        backend: the ranks' torch.distributed backend ("gloo"; "nccl" with a GPU per rank).

    The job ends, and every rank with it, when a rank fails (its peers are not waited for),
    dies before reporting, is stopped (the OS says so, or it falls silent), or does not start
    in time; the error names the rank. Ranks exit by themselves when this process is gone.
    A rendezvous that fails before any rank ran ``fn`` (gloo's loopback mesh, rarely, on a
    loaded machine) starts the job once more, on a fresh port.
    """
    if not callable(fn):
        raise TypeError(f"spawn(fn={fn!r}): fn must be a module-level function")
    world_size = positive_int("spawn", "world_size", world_size)
    for name, value in (("timeout_s", timeout_s), ("collective_timeout_s", collective_timeout_s),
                        ("silent_s", silent_s), ("start_timeout_s", start_timeout_s)):
        _seconds("spawn", name, value)
    for attempt in range(2):
        try:
            return _spawn_once(fn, world_size, args, timeout_s, collective_timeout_s, silent_s,
                               start_timeout_s, start_method, backend)
        except _RendezvousFailed as failed:
            if attempt:
                raise RankError(f"rank {failed.rank} could not join the other ranks (twice): "
                                f"{failed.text}") from None


class _RendezvousFailed(Exception):
    def __init__(self, rank: int, text: str) -> None:
        super().__init__(rank, text)
        self.rank, self.text = rank, text


@contextlib.contextmanager
def _children_ignore_interrupts():
    """Ctrl-C ignored in what is started inside (a fresh interpreter inherits it through its
    exec): the fork server and a spawned rank import torch before they can ignore Ctrl-C
    themselves, and one then printed its own KeyboardInterrupt traceback. Only for the
    milliseconds of a fork and exec: this process ignores it meanwhile (its other threads
    would discard a Ctrl-C they take), and it is set on the main thread only."""
    interrupt = (signal.getsignal(signal.SIGINT)
                 if threading.current_thread() is threading.main_thread() else None)
    if interrupt is None:  # not the main thread, or a handler set outside Python: as it is
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, interrupt)


def _context(start_method: str, fn):
    import torch.multiprocessing as mp

    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', not {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # what the server imports once, before its first fork (later calls change nothing
        # while it runs; a rank imports any other module itself)
        module = getattr(fn, "__module__", None)
        ctx.set_forkserver_preload(["torch", "torch.distributed", __name__]
                                   + ([module] if module and module != "__main__" else []))
    return ctx


def _spawn_once(fn, world_size, args, timeout_s, collective_timeout_s, silent_s,
                start_timeout_s, start_method, backend) -> list:
    ctx = _context(start_method, fn)
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]  # (parent's end, rank's end)
    # ranks that started early wait at the rendezvous for the late ones
    join = max(JOIN_TIMEOUT_S, start_timeout_s)
    env = dict(os.environ)
    procs = [ctx.Process(target=_spawn_entry, args=(r, world_size, port, fn, args, pipes[r][1],
                                                     env, collective_timeout_s, join, backend))
             for r in range(world_size)]
    try:
        # a signal that ends the job while a rank starts (SIGTERM, Ctrl-C) waits until every
        # rank has a pid here, so the cleanup below stops them all; none runs on unknown
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            if start_method == "forkserver":
                with _children_ignore_interrupts():  # the server's fork and exec only
                    forkserver.ensure_running()
                for p in procs:
                    p.start()  # (waits while the server imports torch)
            else:
                with _children_ignore_interrupts():  # each rank's fork and exec
                    for p in procs:
                        p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for _, theirs in pipes:
            theirs.close()  # so a dead rank shows up as the end of its pipe here
        return _Watch(procs, [ours for ours, _ in pipes], timeout_s, silent_s,
                      start_timeout_s).collect()
    finally:
        for p in procs:
            if p.pid is None:  # the job ended before this rank started
                continue
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        for ours, _ in pipes:
            ours.close()


class _Watch:
    """The spawner's view of its ranks until each has reported (or the job ends)."""

    def __init__(self, procs, conns, timeout_s: float, silent_s: float,
                 start_timeout_s: float) -> None:
        self.procs, self.conns = procs, conns
        self.timeout_s, self.silent_s, self.start_timeout_s = timeout_s, silent_s, start_timeout_s
        self.start = time.monotonic()
        self.beats: dict[int, float] = {}  # rank -> last heartbeat (from its first one on)
        self.first_beats: dict[int, float] = {}  # rank -> when its first heartbeat arrived
        self.stopped: dict[int, float] = {}  # rank -> when the OS first reported it stopped
        self.results: dict[int, object] = {}
        self.errors: list = []
        self.rendezvous: dict[int, str] = {}  # ranks that could not join, and why
        self.closed: set[int] = set()  # ranks whose pipe has ended

    def _done(self) -> set[int]:
        return set(self.results) | {e[0] for e in self.errors}

    def _receive(self, rank: int) -> None:
        conn = self.conns[rank]
        try:
            while conn.poll():
                status, payload = pickle.loads(conn.recv_bytes())
                self.beats[rank] = time.monotonic()
                self.first_beats.setdefault(rank, self.beats[rank])
                if status == "ok":
                    self.results[rank] = pickle.loads(payload)
                elif status == "error":
                    self.errors.append((rank, *payload))
                elif status == "rendezvous":
                    self.rendezvous[rank] = payload
        except (EOFError, OSError):
            self.closed.add(rank)

    def _lost(self, rank: int, now: float) -> str | None:
        """Why ``rank`` (not yet reported) ends the job now, or None."""
        p = self.procs[rank]
        if p.exitcode is not None and rank in self.closed:
            how = (f"was killed (signal {-p.exitcode})" if p.exitcode < 0
                   else f"exited with code {p.exitcode}")
            return f"rank {rank} {how} before reporting"
        state = process_state(p.pid) if p.pid is not None else None
        if state in ("T", "t"):
            since = self.stopped.setdefault(rank, now)
            if now - since >= STOPPED_S:
                return (f"rank {rank} stopped responding (its process is stopped, state "
                        f"{state})")
        else:
            self.stopped.pop(rank, None)
        last = self.beats.get(rank)  # None: not started yet (``_started_late`` judges that)
        if last is not None and now - last > self.silent_s:
            return f"rank {rank} stopped responding (no heartbeat for {self.silent_s:.0f} s)"
        return None

    def _started_late(self, now: float) -> str | None:
        """The first rank whose first heartbeat arrived (or has not, by ``now``) later than
        the start window after the spawn, done since or not: a rank that ran its whole job
        before the spawner read its pipe still started when its first message arrived."""
        for rank in range(len(self.procs)):
            first = self.first_beats.get(rank, now)
            if first - self.start > self.start_timeout_s:
                return f"rank {rank} did not start within {self.start_timeout_s:.0f} s"
        return None

    def collect(self) -> list:
        from multiprocessing.connection import wait

        world_size = len(self.procs)
        first_error = None
        lost = None
        started = None  # when the last rank's first heartbeat arrived
        while len(self._done()) < world_size:
            waiting = [self.conns[r] for r in range(world_size) if r not in self.closed]
            sentinels = [p.sentinel for r, p in enumerate(self.procs) if r not in self._done()]
            ready = wait(waiting + sentinels, timeout=0.5)
            for rank, conn in enumerate(self.conns):
                if conn in ready:
                    self._receive(rank)
            now = time.monotonic()
            if self.errors and first_error is None:
                first_error = now
            if started is None and len(self.beats) == world_size:
                started = now
            for rank in sorted(set(range(world_size)) - self._done()):
                if rank not in self.closed and self.procs[rank].exitcode is not None:
                    self._receive(rank)  # whatever it wrote before it ended
                    if rank in self._done():
                        continue
                    self.closed.add(rank)
                lost = lost or self._lost(rank, now)
            lost = lost or self._started_late(now)
            if self.rendezvous:
                rank = min(self.rendezvous)
                raise _RendezvousFailed(rank, self.rendezvous[rank].splitlines()[0])
            # peers of a failed rank sit in a collective until it times out: do not wait
            if (lost or (started is not None and now - started > self.timeout_s)
                    or (first_error and now - first_error > 10)):
                break
        return self._outcome(lost)

    def _outcome(self, lost) -> list:
        world_size = len(self.procs)
        if self.errors:
            # a bad input on any rank is the cause (its peers then fail on the dead rank, e.g.
            # a pipeline stage's send): the same one-line error as in-process; otherwise the
            # errors in the order they arrived, the first one most likely the cause
            for _rank, exc, _text in self.errors:
                exc = pickle.loads(exc) if exc is not None else None
                if isinstance(exc, ValueError):
                    raise exc
            if lost is None:
                raise RankError("a rank failed:\n" + "\n".join(f"rank {r}: {t}"
                                                                for r, _, t in self.errors))
        if lost is not None:
            raise RankError(lost + "; the job was stopped")
        if len(self.results) < world_size:
            missing = sorted(set(range(world_size)) - set(self.results))
            raise RankError(f"ranks {missing} did not report within {self.timeout_s:.0f} s "
                            "of starting; the job was stopped")
        return [self.results[r] for r in range(world_size)]
