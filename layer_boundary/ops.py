"""Collective and token-row primitives. Each states its row contract in one line.

All collectives of the package go through here, so the ledger sees every one, and a size-1
group short-circuits without touching torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .runtime.ledger import LEDGER
from .runtime.parallel import Group


def all_reduce_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Rows unchanged; every rank ends with the group sum of its rows (reuses ``x``'s storage)."""
    if group.size == 1:
        return x
    LEDGER.record("all_reduce", group, x.numel(), x.dtype)
    x = x.contiguous()
    dist.all_reduce(x, group=group.pg)
    return x


def gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Rows unchanged; the last dim becomes the concatenation of every rank's slice in rank order."""
    if group.size == 1:
        return x
    LEDGER.record("all_gather", group, x.numel() * group.size, x.dtype)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x, group=group.pg)
    return torch.cat(parts, dim=-1)
