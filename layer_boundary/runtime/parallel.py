"""Topology: validated parallel degrees, the process groups they imply, and process start-up.

Rank order (DESIGN.md): ``world = pp x tp``, pipeline stage major (the ranks of one stage are
contiguous); inside a TP group ``tp = attn_dp x attn_cp x attn_tp`` with dp-major order, then
cp, then attention TP fastest. A ``pp`` group joins the ranks at one TP position across the
stages: a stage sends its rows to the same position of the next stage.  Every rank builds every
group in the same order, once, here; nothing else in the package creates groups.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class TopologyError(ValueError):
    """A parallel degree that does not fit the world or the model."""


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees, checked against each other and the world size in one place."""

    world_size: int = 1
    tp: int = 1
    pp: int = 1
    attn_dp: int = 1
    attn_cp: int = 1
    moe_ep: int = 1  # expert parallelism over the TP ranks: tp = moe_ep x moe_tp

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "attn_dp", "attn_cp", "moe_ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopologyError(f"{name} must be a positive integer, got {value!r}")
        if self.pp * self.tp != self.world_size:
            raise TopologyError(
                f"world_size {self.world_size} != pp {self.pp} x tp {self.tp}"
            )
        if self.tp % (self.attn_dp * self.attn_cp) != 0:
            raise TopologyError(
                f"tp {self.tp} is not divisible by attn_dp {self.attn_dp} x attn_cp {self.attn_cp}"
            )
        if self.tp % self.moe_ep != 0:
            raise TopologyError(f"tp {self.tp} is not divisible by moe_ep {self.moe_ep}")

    @property
    def attn_tp(self) -> int:
        return self.tp // (self.attn_dp * self.attn_cp)

    @property
    def moe_tp(self) -> int:
        return self.tp // self.moe_ep


@dataclass(frozen=True, eq=False)
class Group:
    """One process group as this rank sees it. A size-1 group carries no torch group."""

    name: str
    ranks: tuple[int, ...]
    rank: int  # this process's index inside ``ranks``
    pg: object = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def key(self) -> str:
        """Names this group among all groups of the world (for ``process_group``)."""
        return f"{self.name}:{','.join(map(str, self.ranks))}"


# torch process groups by Group.key: code that can carry only strings (a custom op traced by
# torch.compile) finds its group here
_PROCESS_GROUPS: dict[str, object] = {}


def process_group(key: str):
    return _PROCESS_GROUPS[key]


@dataclass(frozen=True, eq=False)
class Parallel:
    """All groups of one topology for this rank (torchtitan's ParallelDims plus its mesh)."""

    dims: ParallelDims
    rank: int
    tp: Group  # full tensor-parallel group (dense FFN sums)
    attn_tp: Group  # attention tensor-parallel group inside one attention-DP rank
    attn_dp: Group  # same attention-TP index across attention-DP ranks
    # same TP position across pipeline stages, in stage order: a rank's pipeline neighbours
    # are the previous and next members (point-to-point pairs inside this group)
    pp: Group = field(default=None)

    def __post_init__(self) -> None:
        if self.pp is None:
            object.__setattr__(self, "pp", _local_group("pp"))

    @property
    def pp_rank(self) -> int:
        return self.pp.rank

    @property
    def first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def attn_tp_rank(self) -> int:
        return self.attn_tp.rank

    @property
    def moe_ep_rank(self) -> int:
        # ep-major over the TP group: the moe_tp shards of one expert slice are adjacent
        return self.tp.rank // self.dims.moe_tp

    @property
    def moe_tp_rank(self) -> int:
        return self.tp.rank % self.dims.moe_tp

    @property
    def attn_dp_rank(self) -> int:
        # dp-major rank order inside the TP group
        return self.tp.rank // (self.dims.attn_cp * self.dims.attn_tp)


def _local_group(name: str) -> Group:
    return Group(name=name, ranks=(0,), rank=0, pg=None)


# how long a collective may wait for a peer before the job ends (an inference collective takes
# milliseconds; a silent peer is a stopped or dead rank): set by init_distributed
_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=45)
JOIN_TIMEOUT_S = 300.0  # the world group: rendezvous of ranks that start at different times


def _new_groups(name: str, all_ranks: list[list[int]], rank: int) -> Group:
    """Create every group of one kind (all ranks call this in the same order); keep ours."""
    mine = None
    for ranks in all_ranks:
        pg = dist.new_group(ranks, timeout=_COLLECTIVE_TIMEOUT) if len(ranks) > 1 else None
        if rank in ranks:
            mine = Group(name=name, ranks=tuple(ranks), rank=ranks.index(rank), pg=pg)
            if pg is not None:
                _PROCESS_GROUPS[mine.key] = pg
    assert mine is not None, f"rank {rank} is in no {name} group"
    return mine


_PARALLEL_CACHE: dict[ParallelDims, Parallel] = {}


def group_layout(dims: ParallelDims) -> dict[str, list[list[int]]]:
    """Every group of each kind, as global rank lists, in creation order."""
    tp, attn_tp = dims.tp, dims.attn_tp
    stride = dims.attn_cp * attn_tp
    return {
        "tp": [list(range(p * tp, (p + 1) * tp)) for p in range(dims.pp)],
        "attn_tp": [list(range(base + j * attn_tp, base + (j + 1) * attn_tp))
                    for base in range(0, dims.world_size, tp) for j in range(tp // attn_tp)],
        "attn_dp": [list(range(base + off, base + tp, stride))
                    for base in range(0, dims.world_size, tp) for off in range(stride)],
        "pp": [list(range(pos, dims.world_size, tp)) for pos in range(tp)],
    }


def build_parallel(dims: ParallelDims) -> Parallel:
    """Groups for ``dims``; built once per process and topology, then reused."""
    cached = _PARALLEL_CACHE.get(dims)
    if cached is not None:
        return cached
    if dims.world_size == 1:
        par = Parallel(dims, 0, _local_group("tp"), _local_group("attn_tp"), _local_group("attn_dp"))
        _PARALLEL_CACHE[dims] = par
        return par
    if not dist.is_initialized():
        raise TopologyError(
            f"world_size {dims.world_size} needs torch.distributed to be initialised")
    if dist.get_world_size() != dims.world_size:
        raise TopologyError(
            f"world_size {dims.world_size} != torch.distributed world size {dist.get_world_size()}")
    rank = dist.get_rank()
    groups = {name: _new_groups(name, ranks, rank) for name, ranks in group_layout(dims).items()}
    par = Parallel(dims, rank, groups["tp"], groups["attn_tp"], groups["attn_dp"], groups["pp"])
    _PARALLEL_CACHE[dims] = par
    return par


def virtual_parallel(dims: ParallelDims, rank: int = 0) -> Parallel:
    """Rank ``rank``'s view of ``dims`` without process groups: for plans, never collectives."""
    def mine(name, all_ranks):
        ranks = next(r for r in all_ranks if rank in r)
        return Group(name=name, ranks=tuple(ranks), rank=ranks.index(rank), pg=None)

    layout = group_layout(dims)
    return Parallel(dims, rank, *(mine(n, layout[n]) for n in ("tp", "attn_tp", "attn_dp", "pp")))


# ---------------------------------------------------------------- process start-up


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def init_distributed(rank: int | None = None, world_size: int | None = None,
                     init_method: str | None = None, backend: str = "gloo",
                     timeout_s: float = 45.0) -> tuple[int, int]:
    """Initialise torch.distributed once: from torchrun's environment or explicit arguments.
    ``timeout_s`` bounds every collective of the groups built later (every boundary
    collective runs on one): a peer silent that long (stopped, dead) ends the job instead of
    stalling it. Joining the world (ranks still importing, loading) may take longer."""
    global _COLLECTIVE_TIMEOUT
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    _COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=timeout_s)
    if rank is None:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        init_method = "env://"
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S)))
    return rank, world_size


class RankError(RuntimeError):
    """A spawned rank failed; carries the first rank's exception when it can be re-raised."""


HEARTBEAT_S = 2.0  # a rank reports it is alive this often
SILENT_S = 20.0  # a rank silent this long (stopped, stuck) ends the job


def _watch(queue, rank: int, parent: int) -> None:
    """A rank's daemon thread: heartbeats to the spawner, and an exit when the spawner is gone
    (whatever killed it), so no rank outlives the job."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        queue.put((rank, "beat", None))
        time.sleep(HEARTBEAT_S)


def _spawn_entry(rank, world_size, port, fn, args, queue, parent, timeout_s):
    import threading

    threading.Thread(target=_watch, args=(queue, rank, parent), daemon=True).start()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    init_distributed(rank, world_size, f"tcp://127.0.0.1:{port}", timeout_s=timeout_s)
    try:
        # plain pickle copies tensors by value; the queue's pickler would share file
        # descriptors that vanish when this process exits
        queue.put((rank, "ok", pickle.dumps(fn(*args))))
    except Exception as exc:  # report to the parent, which decides what the user sees
        import traceback

        try:
            payload = pickle.dumps(exc)
        except Exception:
            payload = None
        queue.put((rank, "error", (payload, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")))
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args, timeout_s: float = 600.0,
          collective_timeout_s: float = 45.0, silent_s: float = SILENT_S) -> list:
    """Run ``fn(*args)`` on ``world_size`` local CPU ranks over gloo; return per-rank results.

    The job ends, and every rank with it, when a rank fails (its peers are not waited for),
    dies before reporting, or falls silent (no heartbeat for ``silent_s``: stopped or stuck);
    the error names the rank. Ranks exit by themselves when this process is gone.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_spawn_entry, args=(r, world_size, port, fn, args, queue,
                                                     os.getpid(), collective_timeout_s))
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        return _collect(procs, queue, world_size, timeout_s, silent_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


def _collect(procs, queue, world_size: int, timeout_s: float, silent_s: float) -> list:
    results: dict[int, object] = {}
    errors: list = []
    start = time.monotonic()
    beats = {r: start for r in range(world_size)}
    deadline = start + timeout_s
    first_error = None
    lost = None  # a rank that died or fell silent: (rank, why)
    while len(results) + len(errors) < world_size:
        if not queue.empty():
            rank, status, payload = queue.get()
            beats[rank] = time.monotonic()
            if status == "ok":
                results[rank] = pickle.loads(payload)
            elif status == "error":
                errors.append((rank, *payload))
                first_error = first_error or time.monotonic()
            continue
        now = time.monotonic()
        done = set(results) | {e[0] for e in errors}
        for r, p in enumerate(procs):
            if r in done:
                continue
            if p.exitcode is not None and queue.empty():
                how = (f"was killed (signal {-p.exitcode})" if p.exitcode < 0
                       else f"exited with code {p.exitcode}")
                lost = lost or (r, f"rank {r} {how} before reporting")
            elif now - beats[r] > silent_s:
                lost = lost or (r, f"rank {r} stopped responding (no heartbeat for "
                                   f"{silent_s:.0f} s)")
        # peers of a failed rank sit in a collective until it times out: do not wait for them
        if lost or now > deadline or (first_error and now - first_error > 10):
            break
        time.sleep(0.01)
    if errors:
        # a bad input on any rank is the cause (its peers then fail on the dead rank, e.g. a
        # pipeline stage's send): the same one-line error as in-process; otherwise the errors
        # in the order they arrived, the first one most likely the cause
        for rank, exc, text in errors:
            exc = pickle.loads(exc) if exc is not None else None
            if isinstance(exc, ValueError):
                raise exc
        if lost is None:
            raise RankError("a rank failed:\n" + "\n".join(f"rank {r}: {t}"
                                                            for r, _, t in errors))
    if lost is not None:
        raise RankError(lost[1] + "; the job was stopped")
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise RankError(f"ranks {missing} did not report within {timeout_s:.0f} s; the job was "
                        "stopped")
    return [results[r] for r in range(world_size)]
