"""Token layouts, named sum groups and the topology facts boundaries are resolved against.

A ``Layout`` says which token axes partition a rank's rows; a ``SumGroup`` says which ranks
must still be summed over. Keeping the two apart lets a contract express an unreduced
contribution and the rows its completion must land on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .runtime.parallel import Group, Parallel


class TokenAxis(enum.Enum):
    ATTN_DP = "attn_dp"  # different attention data-parallel token sets
    ATTN_CP = "attn_cp"  # context-parallel partitions of an active CP batch
    ATTN_TP_SCATTER = "attn_tp_scatter"  # token slices spread over attention-TP ranks


@dataclass(frozen=True)
class Layout:
    """Token axes that partition this rank's rows; size-one axes are omitted."""

    sharded: frozenset = frozenset()

    @classmethod
    def of(cls, *axes: TokenAxis, sizes: dict[TokenAxis, int]) -> "Layout":
        return cls(frozenset(a for a in axes if sizes.get(a, 1) > 1))

    def __str__(self) -> str:
        if not self.sharded:
            return "full"
        return "+".join(sorted(a.value for a in self.sharded))


REPLICATED = Layout()


class SumGroup(enum.Enum):
    ATTN_TP = "attn_tp"  # attention tensor parallelism
    TP = "tp"  # the full tensor-parallel group
    MOE_OUT = "moe_out"  # the MoE output reduction group


def token_axis_sizes(parallel: Parallel) -> dict[TokenAxis, int]:
    dims = parallel.dims
    return {TokenAxis.ATTN_DP: dims.attn_dp, TokenAxis.ATTN_CP: dims.attn_cp,
            TokenAxis.ATTN_TP_SCATTER: dims.attn_tp}


def sum_group(parallel: Parallel, which: SumGroup) -> Group:
    """The runtime group a named sum runs over."""
    if which is SumGroup.ATTN_TP:
        return parallel.attn_tp
    if which in (SumGroup.TP, SumGroup.MOE_OUT):
        return parallel.tp
    raise ValueError(f"unknown sum group {which!r}")
