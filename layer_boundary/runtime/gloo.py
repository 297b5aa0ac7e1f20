"""How gloo moves rows fast on a small host: the tactics ``collectives`` takes on a gloo group.

``collectives`` says what each movement is (its row contract, what the ledger records); this
module says how gloo runs it faster than its own calls would where ranks share a few cores:

- a small sum runs as an all-gather and a local sum (``sum_by_gather``), because gloo's
  all-reduce of a small tensor costs more than the gather;
- a reduce-scatter runs as an all-to-all of the blocks and a local sum (``sum_by_exchange``),
  because gloo's own reduce-scatter all-reduces the whole tensor and its work cannot be
  polled;
- a rank waits for a collective by polling it (``complete``, ``waitable``) where this host's
  ranks fit its cores (``waits_by_polling``), instead of sleeping in torch's ``wait()``.

Batch-invariant runs (``runtime.invariant``) take both sums on any backend, for their fixed
order of additions. The measurements behind each choice are in docs/benchmarks.md ("Figures
behind the runtime's choices"). This module imports no other runtime module: ``parallel``
and ``collectives`` both ask it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# ---------------------------------------------------------------- waiting: polled or asleep

# polls before a wait sleeps in torch's ``wait()`` after all: a healthy collective completes
# long before (docs/benchmarks.md), so only a stalled peer, or a work handle that never
# reports completion, reaches it
MAX_POLLS = 1 << 15


def ranks_fit_cores() -> bool:
    """Whether this host's ranks (``LOCAL_WORLD_SIZE``, which torchrun and our spawner set;
    else the world) fit the cores this process may run on.

    A gloo collective that sleeps in ``wait()`` hands its wake-up to the scheduler, which on
    a virtual machine costs a halted vCPU's wake; polling was faster wherever measured
    (docs/benchmarks.md, "Figures behind the runtime's choices"). But where ranks outnumber
    cores, a rank waiting on another's longer work (a later pipeline stage) would keep taking
    turns on the core that work needs, so there they sleep."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or dist.get_world_size())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return local <= (cores or 1)


def waits_by_polling(backend: str | None) -> bool:
    """Whether a rank waits for a group on ``backend`` by polling its collectives, yielding
    the CPU between polls: on gloo, where this host has a core for each of its ranks
    (``ranks_fit_cores``), so a waiting rank's poll takes no core another rank's compute
    needs for long. ``Group.polls`` asks it once per group."""
    return backend == "gloo" and ranks_fit_cores()


def poll(work) -> None:
    """Wait for ``work`` by polling it, then ``wait()`` (which raises a failed collective,
    and sleeps only where ``MAX_POLLS`` ran out)."""
    for _ in range(MAX_POLLS):
        if work.is_completed():  # a failed collective completes too: wait() raises it
            break
        os.sched_yield()
    work.wait()


class _Polled:
    """A work handle whose ``wait()`` polls (what ``issuing_async()`` hands back where the
    group ``polls``)."""

    __slots__ = ("work",)

    def __init__(self, work) -> None:
        self.work = work

    def wait(self) -> None:
        poll(self.work)


def waitable(work, polls: bool):
    """``work`` as an asynchronous caller waits on it: polled where the group ``polls``."""
    return _Polled(work) if polls else work


def complete(call, polls: bool) -> None:
    """Run a torch.distributed call (``call(async_op=...)``) to completion: where the group
    ``polls``, issued asynchronously and polled (compiled graphs trace the plain call)."""
    if polls and not torch.compiler.is_compiling():
        poll(call(async_op=True))
    else:
        call(async_op=False)


# ---------------------------------------------------------------- sums: gathered, exchanged

# up to this many gathered bytes (group size x the tensor's), a sum on gloo runs as a gather:
# beyond it gloo's all-reduce catches up (docs/benchmarks.md)
GATHER_SUM_MAX_BYTES = 1 << 19


def gathers_small_sum(x: torch.Tensor, group) -> bool:
    """Whether gloo sums ``x`` over ``group`` faster as a gather: on gloo, up to
    ``GATHER_SUM_MAX_BYTES`` gathered."""
    return (group.backend == "gloo"
            and group.size * x.numel() * x.element_size() <= GATHER_SUM_MAX_BYTES)


def exchanges_reduce_scatter(group) -> bool:
    """Whether a reduce-scatter over ``group`` runs faster as an exchange: always on gloo,
    whose own reduce-scatter is an all-reduce of the whole tensor (twice the bytes) and whose
    work handle cannot be polled; the exchange moves the ring figure and polls where the
    group does."""
    return group.backend == "gloo"


def sum_by_gather(x: torch.Tensor, group, all_gather) -> torch.Tensor:
    """The group sum of a contiguous ``x``, written into ``x``: every rank's tensor gathered
    (``all_gather(out, x, pg, async_op)``, the torch call the caller resolved) and summed here
    in group rank order, the same sum on every rank."""
    gathered = x.new_empty((group.size * x.numel(),))
    complete(lambda async_op: all_gather(gathered, x.view(-1), group.pg, async_op),
             group.polls)
    return torch.sum(gathered.view(group.size, *x.shape), dim=0, out=x)


def sum_by_exchange(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Rank i gets the sum over the group of block i (``sizes[i]`` rows of a contiguous
    ``x``): the blocks exchanged all-to-all, then the ones this rank receives summed here in
    group rank order."""
    mine = sizes[group.rank]
    received = x.new_empty((group.size * mine, *x.shape[1:]))
    complete(lambda async_op: dist.all_to_all_single(
        received, x, output_split_sizes=[mine] * group.size, input_split_sizes=sizes,
        group=group.pg, async_op=async_op), group.polls)
    return torch.sum(received.view(group.size, mine, *x.shape[1:]), dim=0)
