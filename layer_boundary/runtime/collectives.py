"""Row collectives over one runtime ``Group``. Each states its row contract in one line.

Every collective of the package goes through here, so an observer (the ledger) sees each one.
A size-1 group short-circuits without touching torch.distributed, and so does a collective
whose every participant holds no rows (callers pass sizes every rank agrees on, so all skip
together). Observers are told what a call logically moves: padded rows for fixed-size
collectives, real rows for the variable-size ones, whatever gloo needs underneath. How gloo
runs a movement fast (gathered sums, exchanged reduce-scatters, polled waits) is ``gloo``'s.

The in-place ``torch.distributed`` calls trace under ``torch.compile(fullgraph=True)``; the
one that does not (a reduce-scatter of uneven blocks) runs as a custom op while compiling.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from . import gloo
from .agreement import AGREEMENT
from .gloo import complete as _complete
# names callers and tests read here since before the tactics moved to ``gloo``
from .gloo import GATHER_SUM_MAX_BYTES, MAX_POLLS, poll as _poll  # noqa: F401
from .invariant import BATCH_INVARIANT
from .ledger import active_observer, declares_wire
from .parallel import Group, process_group

# Work handles of the collectives issued inside ``issuing_async()`` (None outside it)
_ISSUED: list | None = None


def _single_tensor_name(new: str, old: str) -> str:
    """The name ``torch.distributed`` gives a single-tensor collective: torch 2.13 added
    ``new`` and deprecated ``old`` (a FutureWarning a call); 2.11 and 2.12 have only ``old``."""
    return new if hasattr(dist, new) else old


# resolved once, at import; each call looks the function up on torch.distributed by this name,
# so a wrapper installed there (a benchmark's clock, a test's recorder) sees every call
ALL_GATHER_SINGLE = _single_tensor_name("all_gather_single", "all_gather_into_tensor")
REDUCE_SCATTER_SINGLE = _single_tensor_name("reduce_scatter_single", "reduce_scatter_tensor")


def _all_gather_single(out, x, pg, async_op: bool):
    return getattr(dist, ALL_GATHER_SINGLE)(out, x, group=pg, async_op=async_op)


def _reduce_scatter_single(out, x, pg, async_op: bool):
    return getattr(dist, REDUCE_SCATTER_SINGLE)(out, x, group=pg, async_op=async_op)


@contextlib.contextmanager
def issuing_async():
    """Inside, the sums whose result is written into storage the caller only views (all-reduce,
    reduce-scatter) are issued with ``async_op=True`` and return at once; the block yields
    the list of (work, tensors kept alive) to wait on before anything reads those results.
    Collectives whose own code reads their result (gathers) stay synchronous."""
    global _ISSUED
    outer, _ISSUED = _ISSUED, []
    try:
        yield _ISSUED
    finally:
        _ISSUED = outer


def _synchronous() -> bool:
    """Whether a collective issued now completes before it returns: outside
    ``issuing_async()``, or while compiling (a graph traces the plain call)."""
    return _ISSUED is None or torch.compiler.is_compiling()


def _issue(call, polls: bool, *keep) -> None:
    """Run a torch.distributed call, asynchronously inside ``issuing_async()``."""
    if _synchronous():
        _complete(call, polls)
    else:
        _ISSUED.append((gloo.waitable(call(async_op=True), polls), keep))


def _observe(kind: str, group: Group, numel: int, dtype, site: str | None,
             wire_numel: int | None = None, wire_kind: str | None = None) -> None:
    """Before each collective: the agreement check (where on), then the observer."""
    if AGREEMENT.on:
        _agree(kind, group, numel, dtype)
    observer = active_observer()
    if observer is None:
        return
    if wire_numel is not None and declares_wire(observer):
        observer.collective(kind, group, numel, dtype, site, wire_numel=wire_numel,
                            wire_kind=wire_kind)
    else:
        observer.collective(kind, group, numel, dtype, site)


def _agree(kind: str, group: Group, numel: int, dtype) -> None:
    """The agreement check before a collective (``runtime.agreement``): every rank's
    fingerprint gathered over the group (polled where the group polls), then compared."""
    mine = AGREEMENT.fingerprint(kind, group, numel, dtype)
    if mine is None:
        return
    every = mine.new_empty((group.size * mine.numel(),))
    _complete(lambda async_op: _all_gather_single(every, mine, group.pg, async_op),
              group.polls)
    AGREEMENT.compare(every.view(group.size, -1), mine, group)


def sums_by_gather(x: torch.Tensor, group: Group) -> bool:
    """Whether ``all_reduce_rows`` sums ``x`` over ``group`` as an all-gather and a local sum:
    where gloo gathers it faster (``gloo.gathers_small_sum``); NCCL's all-reduce is the one
    to use. Batch-invariant (``runtime.invariant``): always, so each element's sum is the
    same additions in group rank order whatever the tensor's size."""
    return BATCH_INVARIANT.on or gloo.gathers_small_sum(x, group)


def all_reduce_rows(x: torch.Tensor, group: Group, site: str | None = None) -> torch.Tensor:
    """Rows unchanged; every rank ends with the group sum of its rows (reuses ``x``'s storage).

    Where ``sums_by_gather`` holds and the call is synchronous, every rank's tensor is
    gathered and summed here in group rank order, the same sum on every rank (the ledger
    keeps the all-reduce as the logical collective; its wire figure is the gather's). Inside
    ``issuing_async()`` torch's all-reduce runs, whose result needs no work after the wait."""
    if group.size == 1 or x.numel() == 0:
        return x
    x = x.contiguous()
    if _synchronous() and sums_by_gather(x, group):
        _observe("all_reduce", group, x.numel(), x.dtype, site,
                 wire_numel=group.size * x.numel(), wire_kind="all_gather")
        return gloo.sum_by_gather(x, group, _all_gather_single)
    _observe("all_reduce", group, x.numel(), x.dtype, site)
    _issue(lambda async_op: dist.all_reduce(x, group=group.pg, async_op=async_op),
           group.polls, x)
    return x


def sums_by_exchange(group: Group) -> bool:
    """Whether a synchronous reduce-scatter over ``group`` runs as an all-to-all of the blocks
    and a local sum of the blocks this rank receives, in group rank order: where gloo
    exchanges it faster (``gloo.exchanges_reduce_scatter``); NCCL's reduce-scatter is the one
    to use. Batch-invariant: always (the sum of a block in group rank order, as
    ``sums_by_gather``)."""
    return BATCH_INVARIANT.on or gloo.exchanges_reduce_scatter(group)


def _sum_by_exchange(x: torch.Tensor, group: Group, sizes: list[int]) -> torch.Tensor:
    """Rank i gets the sum over the group of block i (``sizes[i]`` rows), summed here."""
    mine, width = sizes[group.rank], math.prod(x.shape[1:])
    _observe("reduce_scatter", group, x.numel(), x.dtype, None,
             wire_numel=(sum(sizes) - mine) * width, wire_kind="all_to_all")
    return gloo.sum_by_exchange(x, group, sizes)


def _exchanges(group: Group) -> bool:
    return _ISSUED is None and not torch.compiler.is_compiling() and sums_by_exchange(group)


def reduce_scatter_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Rows split into group.size equal blocks; rank i gets the group sum of block i."""
    if group.size == 1:
        return x
    if x.shape[0] % group.size:
        raise ValueError(f"reduce_scatter_rows needs rows divisible by {group.size}, "
                         f"got {x.shape[0]}")
    block = x.shape[0] // group.size
    if x.numel() == 0:
        return x.new_empty((block, *x.shape[1:]))
    x = x.contiguous()
    if _exchanges(group):
        return _sum_by_exchange(x, group, [block] * group.size)
    out = x.new_empty((block, *x.shape[1:]))
    _observe("reduce_scatter", group, x.numel(), x.dtype, None)
    # never polled: gloo's reduce-scatter work never reports itself completed (torch 2.13)
    _issue(lambda async_op: _reduce_scatter_single(out, x, group.pg, async_op), False, out, x)
    return out


def reduce_scatter_rows_v(x: torch.Tensor, group: Group, sizes: tuple[int, ...]) -> torch.Tensor:
    """Rows split into consecutive blocks of ``sizes[i]`` rows; rank i gets the group sum of
    block i."""
    if group.size == 1:
        return x
    if sum(sizes) == 0:
        return x
    if _exchanges(group):
        return _sum_by_exchange(x.contiguous(), group, list(sizes))
    _observe("reduce_scatter", group, x.numel(), x.dtype, None)
    if torch.compiler.is_compiling():
        return torch.ops.layer_boundary.reduce_scatter_v(x, group.key, list(sizes), group.rank)
    return _reduce_scatter_v(x, group.pg, sizes, group.rank)


def _reduce_scatter_v(x, pg, sizes, rank):
    blocks = list(x.contiguous().split(list(sizes), dim=0))
    out = x.new_empty((sizes[rank], *x.shape[1:]))
    # never polled, as reduce_scatter_rows
    _issue(lambda async_op: dist.reduce_scatter(out, blocks, group=pg, async_op=async_op),
           False, out, blocks)
    return out


@torch.library.custom_op("layer_boundary::reduce_scatter_v", mutates_args=())
def _reduce_scatter_v_op(x: torch.Tensor, group_key: str, sizes: list[int],
                         rank: int) -> torch.Tensor:
    return _reduce_scatter_v(x, process_group(group_key), sizes, rank)


@_reduce_scatter_v_op.register_fake
def _(x, group_key, sizes, rank):
    return x.new_empty((sizes[rank], *x.shape[1:]))


# A collective is a side effect: every rank must run it even where its own result is unused
# or empty (a rank with no rows), so compilers may never drop it.
torch.fx.node.has_side_effect(torch.ops.layer_boundary.reduce_scatter_v.default)


def gather_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's equal-size rows concatenated in group rank order, on every rank."""
    if group.size == 1:
        return x
    out = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))
    if x.numel() == 0:
        return out
    _observe("all_gather", group, out.numel(), x.dtype, None)
    x = x.contiguous()
    _complete(lambda async_op: _all_gather_single(out, x, group.pg, async_op), group.polls)
    return out


def gather_rows_v(x: torch.Tensor, group: Group, sizes: tuple[int, ...]) -> torch.Tensor:
    """Rank i contributes ``sizes[i]`` rows; every rank gets them all, concatenated in rank
    order."""
    if group.size == 1:
        return x
    widest = max(sizes)
    if widest == 0:
        return x.new_empty((0, *x.shape[1:]))
    width = math.prod(x.shape[1:])
    # gloo has no uneven all-gather: pad every block to the widest, then drop the padding
    _observe("all_gather", group, sum(sizes) * width, x.dtype, None,
             wire_numel=widest * group.size * width)
    padded = x.new_zeros((widest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((widest * group.size, *x.shape[1:]))
    _complete(lambda async_op: _all_gather_single(out, padded, group.pg, async_op), group.polls)
    return torch.cat([out[i * widest: i * widest + n] for i, n in enumerate(sizes)])


def wire_device(group: Group) -> torch.device:
    """Where a tensor made on the host (counts, headers, a receive buffer) must be to cross
    ``group``: NCCL moves CUDA tensors only (this rank's GPU), gloo CPU ones."""
    if group.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange_counts(counts: list, group: Group) -> list:
    """Rank i sends ``counts[j]`` (an int, or a list of ints of one length) to rank j;
    returns what every rank sent this one, in group rank order (the sizes an uneven
    all-to-all needs on both sides, and whatever else every pair must agree on first)."""
    if group.size == 1:
        return list(counts)
    send = torch.tensor(counts, dtype=torch.int64, device=wire_device(group))
    recv = torch.empty_like(send)
    _observe("all_to_all", group, send.numel() // group.size * (group.size - 1), send.dtype,
             None)
    _complete(lambda async_op: dist.all_to_all_single(recv, send, group=group.pg,
                                                      async_op=async_op), group.polls)
    return recv.tolist()


def all_to_all_rows(x: torch.Tensor, group: Group, send: list[int],
                    recv: list[int]) -> torch.Tensor:
    """Rows split into consecutive blocks of ``send[j]`` rows, block j to rank j; returns the
    blocks every rank sent this one (``recv[i]`` rows from rank i), concatenated in group rank
    order. The ledger counts the elements this rank sends to the others (its own block stays)."""
    if group.size == 1:
        return x
    width = math.prod(x.shape[1:])
    out = x.new_empty((sum(recv), *x.shape[1:]))
    # no local skip: a rank that neither sends nor receives cannot know that no other pair
    # exchanges rows, so every rank takes part in every all-to-all
    _observe("all_to_all", group, (sum(send) - send[group.rank]) * width, x.dtype, None)
    x = x.contiguous()
    _complete(lambda async_op: dist.all_to_all_single(
        out, x, output_split_sizes=list(recv), input_split_sizes=list(send), group=group.pg,
        async_op=async_op), group.polls)
    return out


def gather_last_dim(x: torch.Tensor, group: Group, site: str | None = None) -> torch.Tensor:
    """Rows unchanged; the last dim becomes the concatenation of every rank's slice in rank
    order."""
    if group.size == 1:
        return x
    if x.numel() == 0:  # no rows anywhere in this group: nothing to move
        return x.new_empty((*x.shape[:-1], x.shape[-1] * group.size))
    _observe("all_gather", group, x.numel() * group.size, x.dtype, site)
    parts = [torch.empty_like(x) for _ in range(group.size)]
    x = x.contiguous()
    _complete(lambda async_op: dist.all_gather(parts, x, group=group.pg, async_op=async_op),
              group.polls)
    return torch.cat(parts, dim=-1)


# ---------------------------------------------------------------- pipeline point to point

_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                torch.int32, torch.bool)


def send_to_next_stage(tensors: dict, group: Group, site: str | None = None) -> None:
    """Named tensors to the same TP position of the next pipeline stage; rows unchanged.

    A header (names, dtypes, shapes) goes first, so the receiver allocates exactly what
    arrives and checks it against what its own plan expects; empty tensors send no payload.
    """
    if group.rank + 1 >= group.size:
        raise RuntimeError("the last pipeline stage has no next stage to send to")
    dst, wire = group.ranks[group.rank + 1], wire_device(group)
    header = [len(tensors)]
    for name, t in tensors.items():
        code = list(name.encode())
        header += [len(code), *code, _WIRE_DTYPES.index(t.dtype), t.dim(), *t.shape]
    header = torch.tensor(header, dtype=torch.int64, device=wire)
    _send(torch.tensor([header.numel()], dtype=torch.int64, device=wire), dst, group)
    _send(header, dst, group)
    for t in tensors.values():
        if t.numel():
            _observe("send", group, t.numel(), t.dtype, site)
            _send(t.to(wire).contiguous(), dst, group)


def _send(t: torch.Tensor, dst: int, group: Group) -> None:
    _complete(lambda async_op: (dist.isend if async_op else dist.send)(t, dst=dst,
                                                                        group=group.pg),
              group.polls)


def _recv(t: torch.Tensor, src: int, group: Group) -> None:
    _complete(lambda async_op: (dist.irecv if async_op else dist.recv)(t, src=src,
                                                                        group=group.pg),
              group.polls)


def recv_from_prev_stage(group: Group, site: str | None = None,
                         device: torch.device | None = None) -> dict:
    """The named tensors the previous pipeline stage's same TP position sent, in its order,
    on ``device`` (default: where ``group``'s backend receives them)."""
    if group.rank == 0:
        raise RuntimeError("the first pipeline stage has no previous stage to receive from")
    src, wire = group.ranks[group.rank - 1], wire_device(group)
    size = torch.empty(1, dtype=torch.int64, device=wire)
    _recv(size, src, group)
    header = torch.empty(int(size.item()), dtype=torch.int64, device=wire)
    _recv(header, src, group)
    fields, i, out = header.tolist(), 1, {}
    for _ in range(fields[0]):
        n = fields[i]
        name = bytes(fields[i + 1:i + 1 + n]).decode()
        i += 1 + n
        dtype, ndim = _WIRE_DTYPES[fields[i]], fields[i + 1]
        shape = fields[i + 2:i + 2 + ndim]
        i += 2 + ndim
        t = torch.empty(shape, dtype=dtype, device=wire)
        if t.numel():
            _observe("recv", group, t.numel(), t.dtype, site)
            _recv(t, src, group)
        out[name] = t if device is None else t.to(device)
    return out


def broadcast_from_last_stage(x: torch.Tensor, group: Group, site: str | None = None):
    """Rows unchanged; every pipeline stage ends with the last stage's ``x`` (same shape on
    every stage), e.g. the tokens it sampled."""
    if group.size == 1:
        return x
    x = x.contiguous()
    if x.numel():
        _observe("broadcast", group, x.numel(), x.dtype, site)
        _complete(lambda async_op: dist.broadcast(x, src=group.ranks[-1], group=group.pg,
                                                  async_op=async_op), group.polls)
    return x
