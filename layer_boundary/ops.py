"""Collective and token-row primitives. Each states its row contract in one line.

All collectives of the package go through here, so the ledger sees every one. A size-1 group
short-circuits without touching torch.distributed, and so does a collective whose every
participant holds no rows (callers pass sizes every rank agrees on, so all skip together).
The ledger records what a path logically moves: padded rows for fixed-size collectives,
real rows for the variable-size ones, whatever gloo needs underneath.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .runtime.ledger import LEDGER
from .runtime.parallel import Group


def all_reduce_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Rows unchanged; every rank ends with the group sum of its rows (reuses ``x``'s storage)."""
    if group.size == 1 or x.numel() == 0:
        return x
    LEDGER.record("all_reduce", group, x.numel(), x.dtype)
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
    LEDGER.record("reduce_scatter", group, x.numel(), x.dtype)
    dist.reduce_scatter_single(out, x.contiguous(), group=group.pg)
    return out


def reduce_scatter_rows_v(x: torch.Tensor, group: Group, sizes: tuple[int, ...]) -> torch.Tensor:
    """Rows split into consecutive blocks of ``sizes[i]`` rows; rank i gets the group sum of block i."""
    if group.size == 1:
        return x
    if sum(sizes) == 0:
        return x
    LEDGER.record("reduce_scatter", group, x.numel(), x.dtype)
    blocks = list(x.contiguous().split(list(sizes), dim=0))
    out = x.new_empty((sizes[group.rank], *x.shape[1:]))
    dist.reduce_scatter(out, blocks, group=group.pg)
    return out


def gather_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's equal-size rows concatenated in group rank order, on every rank."""
    if group.size == 1:
        return x
    out = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))
    if x.numel() == 0:
        return out
    LEDGER.record("all_gather", group, out.numel(), x.dtype)
    dist.all_gather_single(out, x.contiguous(), group=group.pg)
    return out


def gather_rows_v(x: torch.Tensor, group: Group, sizes: tuple[int, ...]) -> torch.Tensor:
    """Rank i contributes ``sizes[i]`` rows; every rank gets them all, concatenated in rank order."""
    if group.size == 1:
        return x
    widest = max(sizes)
    if widest == 0:
        return x.new_empty((0, *x.shape[1:]))
    LEDGER.record("all_gather", group, sum(sizes) * math.prod(x.shape[1:]), x.dtype)
    # gloo has no uneven all-gather: pad every block to the widest, then drop the padding
    padded = x.new_zeros((widest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((widest * group.size, *x.shape[1:]))
    dist.all_gather_single(out, padded, group=group.pg)
    return torch.cat([out[i * widest: i * widest + n] for i, n in enumerate(sizes)])


def gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Rows unchanged; the last dim becomes the concatenation of every rank's slice in rank order."""
    if group.size == 1:
        return x
    if x.numel() == 0:  # no rows anywhere in this group: nothing to move
        return x.new_empty((*x.shape[:-1], x.shape[-1] * group.size))
    LEDGER.record("all_gather", group, x.numel() * group.size, x.dtype)
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.pg)
    return torch.cat(parts, dim=-1)
