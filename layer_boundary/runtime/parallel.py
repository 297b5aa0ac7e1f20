"""Topology: validated parallel degrees and the process groups they imply (process start-up is
``launch.py``).

Rank order (DESIGN.md): ``world = pp x tp``, pipeline stage major (the ranks of one stage are
contiguous); inside a TP group ``tp = attn_dp x attn_cp x attn_tp`` with dp-major order, then
cp, then attention TP fastest. A ``pp`` group joins the ranks at one TP position across the
stages: a stage sends its rows to the same position of the next stage.  Every rank builds every
group in the same order, once, here; nothing else in the package creates groups.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch.distributed as dist

# ranks_fit_cores: read here since before it moved to ``gloo``
from .gloo import ranks_fit_cores, waits_by_polling  # noqa: F401
from .launch import collective_timeout


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

    @functools.cached_property
    def backend(self) -> str | None:
        """The torch backend its collectives run on ("gloo", "nccl"; None for a size-1
        group), asked of torch once."""
        return None if self.pg is None else dist.get_backend(self.pg)

    @functools.cached_property
    def polls(self) -> bool:
        """Whether this rank waits for the group's collectives by polling them, yielding the
        CPU between polls, rather than sleeping in torch's ``wait()``: on gloo, where this
        host has a core for each of its ranks (``gloo.waits_by_polling``). Decided once."""
        return waits_by_polling(self.backend)

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
    """All groups of one topology for this rank (torchtitan's ParallelDims plus its mesh).

    A degree is an int on ``dims`` (``dims.attn_tp``); its group is a ``Group`` here, named
    ``*_group`` (``attn_tp_group``), and its rank ``*_rank``.
    """

    dims: ParallelDims
    rank: int
    tp_group: Group  # full tensor-parallel group (dense FFN sums)
    attn_tp_group: Group  # attention tensor-parallel group inside one attention-DP rank
    attn_dp_group: Group  # same attention CP and TP index across attention-DP ranks
    # same TP position across pipeline stages, in stage order: a rank's pipeline neighbours
    # are the previous and next members (point-to-point pairs inside this group)
    pp_group: Group = field(default=None)
    # same attention-DP and TP index across attention-CP ranks: a CP batch's K/V gather
    attn_cp_group: Group = field(default=None)
    # same attention-TP index across every (DP, CP) rank: a CP batch's row partitions
    dp_cp_group: Group = field(default=None)
    # what is resolved once per topology (ops.movement_table), kept on the topology so that it
    # goes with it: a process-wide memo would keep released groups (and their threads) alive
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.pp_group is None:
            object.__setattr__(self, "pp_group", _local_group("pp"))
        if self.attn_cp_group is None:
            object.__setattr__(self, "attn_cp_group", _local_group("attn_cp"))
        if self.dp_cp_group is None:  # no CP: the partitions are the DP ranks
            object.__setattr__(self, "dp_cp_group", self.attn_dp_group)

    def groups(self) -> tuple[Group, ...]:
        """This rank's groups of the topology (size-1 groups included)."""
        return tuple(dict.fromkeys((self.tp_group, self.attn_tp_group, self.attn_dp_group,
                                    self.pp_group, self.attn_cp_group, self.dp_cp_group)))

    def uncapturable_group(self) -> Group | None:
        """The first of this rank's groups whose collectives a CUDA graph cannot hold, or None
        (NCCL's can, and a size-1 group runs none). gloo runs each collective on its own host
        threads, which a captured graph never calls: replayed, the peers would wait forever,
        and capturing one on CUDA tensors has killed the rank (an H200, torch 2.11)."""
        for group in self.groups():
            if group.pg is not None and group.backend != "nccl":
                return group
        return None

    @property
    def pp_rank(self) -> int:
        return self.pp_group.rank

    @property
    def first_stage(self) -> bool:
        return self.pp_group.rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_group.rank == self.pp_group.size - 1

    @property
    def tp_rank(self) -> int:
        return self.tp_group.rank

    @property
    def attn_tp_rank(self) -> int:
        return self.attn_tp_group.rank

    @property
    def moe_ep_rank(self) -> int:
        # ep-major over the TP group: the moe_tp shards of one expert slice are adjacent
        return self.tp_group.rank // self.dims.moe_tp

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_group.rank % self.dims.moe_tp

    @property
    def attn_dp_rank(self) -> int:
        # dp-major rank order inside the TP group
        return self.tp_group.rank // (self.dims.attn_cp * self.dims.attn_tp)

    @property
    def attn_cp_rank(self) -> int:
        return self.tp_group.rank // self.dims.attn_tp % self.dims.attn_cp


def _local_group(name: str) -> Group:
    return Group(name=name, ranks=(0,), rank=0, pg=None)




def _new_groups(name: str, all_ranks: list[list[int]], rank: int) -> Group:
    """Create every group of one kind (all ranks call this in the same order); keep ours."""
    mine = None
    for ranks in all_ranks:
        pg = (dist.new_group(ranks, timeout=collective_timeout()) if len(ranks) > 1
              else None)
        if rank in ranks:
            mine = Group(name=name, ranks=tuple(ranks), rank=ranks.index(rank), pg=pg)
            if pg is not None:
                _PROCESS_GROUPS[mine.key] = pg
                # asked here once, not first inside a compiled forward
                _ = mine.backend, mine.polls
    assert mine is not None, f"rank {rank} is in no {name} group"
    return mine


# every topology built in this process, least recently built or reused first
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
        # built only where attention CP splits the rows (attn_cp > 1)
        "attn_cp": [list(range(base + d * stride + t, base + (d + 1) * stride, attn_tp))
                    for base in range(0, dims.world_size, tp)
                    for d in range(dims.attn_dp) for t in range(attn_tp)],
        "dp_cp": [list(range(base + t, base + tp, attn_tp))
                  for base in range(0, dims.world_size, tp) for t in range(attn_tp)],
    }


_CP_GROUPS = ("attn_cp", "dp_cp")


def build_parallel(dims: ParallelDims) -> Parallel:
    """Groups for ``dims``; built once per process and topology, then reused."""
    cached = _PARALLEL_CACHE.pop(dims, None)
    if cached is not None:
        _PARALLEL_CACHE[dims] = cached  # now the most recent
        return cached
    if dims.world_size == 1:
        par = Parallel(dims, 0, _local_group("tp"), _local_group("attn_tp"),
                       _local_group("attn_dp"))
        _PARALLEL_CACHE[dims] = par
        return par
    if not dist.is_initialized():
        raise TopologyError(
            f"world_size {dims.world_size} needs torch.distributed to be initialised")
    if dist.get_world_size() != dims.world_size:
        raise TopologyError(
            f"world_size {dims.world_size} != torch.distributed world size {dist.get_world_size()}")
    rank = dist.get_rank()
    groups = {name: _new_groups(name, ranks, rank) for name, ranks in group_layout(dims).items()
              if dims.attn_cp > 1 or name not in _CP_GROUPS}
    par = Parallel(dims, rank, groups["tp"], groups["attn_tp"], groups["attn_dp"], groups["pp"],
                   groups.get("attn_cp"), groups.get("dp_cp"))
    _PARALLEL_CACHE[dims] = par
    return par


def built_topologies() -> tuple[ParallelDims, ...]:
    """The topologies whose groups this process holds, least recently built or reused first."""
    return tuple(_PARALLEL_CACHE)


def release_parallel(dims: ParallelDims) -> None:
    """Destroy the process groups ``build_parallel(dims)`` made in this process.

    Each gloo group keeps a thread that wakes every few milliseconds for as long as the group
    lives, so a process that moves between topologies (an engine that re-shards, a test pool)
    releases the ones it is done with. Every rank of the world releases the same topologies in
    the same order, as it built them: a later ``build_parallel(dims)`` creates the groups
    again, which all ranks must join. A model built on the topology must not run afterwards.

    Args:
        dims: a topology ``build_parallel`` returned groups for; one it never built (or
            already released) is left as it is.
    """
    par = _PARALLEL_CACHE.pop(dims, None)
    if par is None:
        return
    for group in par.groups():
        if group.pg is not None:
            dist.destroy_process_group(group.pg)
    # another topology may hold a group of the same ranks under the same key: the keys
    # point at the most recent holder's group again
    _PROCESS_GROUPS.clear()
    for kept in _PARALLEL_CACHE.values():
        _PROCESS_GROUPS.update((g.key, g.pg) for g in kept.groups() if g.pg is not None)


def virtual_parallel(dims: ParallelDims, rank: int = 0) -> Parallel:
    """Rank ``rank``'s view of ``dims`` without process groups: for plans, never collectives."""
    def mine(name, all_ranks):
        ranks = next(r for r in all_ranks if rank in r)
        return Group(name=name, ranks=tuple(ranks), rank=ranks.index(rank), pg=None)

    layout = group_layout(dims)
    names = ("tp", "attn_tp", "attn_dp", "pp") + (_CP_GROUPS if dims.attn_cp > 1 else ())
    return Parallel(dims, rank, *(mine(n, layout[n]) for n in names))
