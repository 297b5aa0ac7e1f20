"""Row collectives over one runtime ``Group``. Each states its row contract in one line.

Every collective of the package goes through here, so an observer (the ledger) sees each one.
A size-1 group short-circuits without touching torch.distributed, and so does a collective
whose every participant holds no rows (callers pass sizes every rank agrees on, so all skip
together). Observers are told what a call logically moves: padded rows for fixed-size
collectives, real rows for the variable-size ones, whatever gloo needs underneath.

The in-place ``torch.distributed`` calls trace under ``torch.compile(fullgraph=True)``; the
one that does not (a reduce-scatter of uneven blocks) runs as a custom op while compiling.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .ledger import active_observer
from .parallel import Group, process_group

def _observe(kind: str, group: Group, numel: int, dtype, site: str | None) -> None:
    observer = active_observer()
    if observer is not None:
        observer.collective(kind, group, numel, dtype, site)


def all_reduce_rows(x: torch.Tensor, group: Group, site: str | None = None) -> torch.Tensor:
    """Rows unchanged; every rank ends with the group sum of its rows (reuses ``x``'s storage)."""
    if group.size == 1 or x.numel() == 0:
        return x
    _observe("all_reduce", group, x.numel(), x.dtype, site)
    x = x.contiguous()
    dist.all_reduce(x, group=group.pg)
    return x


def reduce_scatter_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Rows split into group.size equal blocks; rank i gets the group sum of block i."""
    if group.size == 1:
        return x
    if x.shape[0] % group.size:
        raise ValueError(f"reduce_scatter_rows needs rows divisible by {group.size}, got {x.shape[0]}")
    out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))
    if x.numel() == 0:
        return out
    _observe("reduce_scatter", group, x.numel(), x.dtype, None)
    dist.reduce_scatter_single(out, x.contiguous(), group=group.pg)
    return out


def reduce_scatter_rows_v(x: torch.Tensor, group: Group, sizes: tuple[int, ...]) -> torch.Tensor:
    """Rows split into consecutive blocks of ``sizes[i]`` rows; rank i gets the group sum of block i."""
    if group.size == 1:
        return x
    if sum(sizes) == 0:
        return x
    _observe("reduce_scatter", group, x.numel(), x.dtype, None)
    if torch.compiler.is_compiling():
        return torch.ops.layer_boundary.reduce_scatter_v(x, group.key, list(sizes), group.rank)
    return _reduce_scatter_v(x, group.pg, sizes, group.rank)


def _reduce_scatter_v(x, pg, sizes, rank):
    blocks = list(x.contiguous().split(list(sizes), dim=0))
    out = x.new_empty((sizes[rank], *x.shape[1:]))
    dist.reduce_scatter(out, blocks, group=pg)
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
    dist.all_gather_single(out, x.contiguous(), group=group.pg)
    return out


def gather_rows_v(x: torch.Tensor, group: Group, sizes: tuple[int, ...]) -> torch.Tensor:
    """Rank i contributes ``sizes[i]`` rows; every rank gets them all, concatenated in rank order."""
    if group.size == 1:
        return x
    widest = max(sizes)
    if widest == 0:
        return x.new_empty((0, *x.shape[1:]))
    _observe("all_gather", group, sum(sizes) * math.prod(x.shape[1:]), x.dtype, None)
    # gloo has no uneven all-gather: pad every block to the widest, then drop the padding
    padded = x.new_zeros((widest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((widest * group.size, *x.shape[1:]))
    dist.all_gather_single(out, padded, group=group.pg)
    return torch.cat([out[i * widest: i * widest + n] for i, n in enumerate(sizes)])


def gather_last_dim(x: torch.Tensor, group: Group, site: str | None = None) -> torch.Tensor:
    """Rows unchanged; the last dim becomes the concatenation of every rank's slice in rank order."""
    if group.size == 1:
        return x
    if x.numel() == 0:  # no rows anywhere in this group: nothing to move
        return x.new_empty((*x.shape[:-1], x.shape[-1] * group.size))
    _observe("all_gather", group, x.numel() * group.size, x.dtype, site)
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.pg)
    return torch.cat(parts, dim=-1)
