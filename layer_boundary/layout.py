"""Token layouts, named sum groups, row modes and the topology facts they are resolved against.

A ``Layout`` says which token axes partition a rank's rows; a ``SumGroup`` says which ranks
must still be summed over. Keeping the two apart lets a contract express an unreduced
contribution and the rows its completion must land on. Layouts hold real token rows only:
padding exists inside a movement's collective, never in a tensor a layout describes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .runtime.parallel import Group, Parallel


class TokenAxis(enum.Enum):
    """A way token rows are split over ranks; a ``Layout`` is the set of axes its rows are
    split on."""

    ATTN_DP = "attn_dp"  # different attention data-parallel token sets
    ATTN_CP = "attn_cp"  # context-parallel partitions of an active CP batch
    ATTN_TP_SCATTER = "attn_tp_scatter"  # token slices spread over attention-TP ranks


@dataclass(frozen=True)
class Layout:
    """Token axes that partition this rank's rows; size-one axes are omitted."""

    sharded: frozenset = frozenset()
    key: str = field(default="", compare=False, repr=False)  # a plain name, for tables

    def __post_init__(self) -> None:
        name = "+".join(sorted(a.value for a in self.sharded)) or "replicated"
        object.__setattr__(self, "key", name)

    @classmethod
    def of(cls, *axes: TokenAxis, sizes: dict[TokenAxis, int]) -> Layout:
        return cls(frozenset(a for a in axes if sizes.get(a, 1) > 1))

    def __str__(self) -> str:
        return self.key


REPLICATED = Layout()


class SumGroup(enum.Enum):
    """The group a partial output is summed over: attention TP, the full TP group, or the MoE
    output's reduction group (the TP group's ranks)."""

    ATTN_TP = "attn_tp"  # attention tensor parallelism
    TP = "tp"  # the full tensor-parallel group
    MOE_OUT = "moe_out"  # the MoE output reduction group


class RowMode(enum.Enum):
    """How a forward's residual lives and how sums onto it travel; one mode per forward.

    ``ar``: the residual on each DP rank's local rows, sums by all-reduce. ``rs``/``rsv``: the
    residual scattered over attention TP, sums by reduce-scatter; ``rs`` cuts each DP rank's
    rows into equal chunks (fixed-size collectives, padded inside the collective), ``rsv``
    into balanced real-row slices (variable-size collectives).
    """

    AR = "ar"
    RS = "rs"
    RSV = "rsv"


def token_axis_sizes(parallel: Parallel, cp: bool = False) -> dict[TokenAxis, int]:
    """Each token axis's size; ``ATTN_CP`` partitions rows only in a CP batch (``cp``)."""
    dims = parallel.dims
    return {TokenAxis.ATTN_DP: dims.attn_dp, TokenAxis.ATTN_CP: dims.attn_cp if cp else 1,
            TokenAxis.ATTN_TP_SCATTER: dims.attn_tp}


def sum_group(parallel: Parallel, which: SumGroup) -> Group:
    """The runtime group a named sum runs over.

    Every rank of the TP group holds experts (moe_ep x moe_tp) and the MoE's input rows, so
    the MoE output reduction group is the TP group's ranks.
    """
    if which is SumGroup.ATTN_TP:
        return parallel.attn_tp_group
    if which in (SumGroup.TP, SumGroup.MOE_OUT):
        return parallel.tp_group
    raise ValueError(f"unknown sum group {which!r}")


@dataclass(frozen=True)
class Layouts:
    """The layouts one topology names (in one batch variant): where compute, the residual and
    the model put their rows.

    ``local`` is what a model passes in and gets back (this DP rank's tokens, in token
    order); ``attention`` is where attention computes and the residual lives under ``ar``:
    the same rows, except in a CP batch, where it is this CP rank's share of them.
    """

    replicated: Layout  # every DP rank's rows on every TP rank (a dense FFN's rows)
    local: Layout  # this DP rank's rows, replicated over attention CP and TP
    scattered: Layout  # the attention rows cut over attention TP (rs/rsv residual)
    attention: Layout  # this DP rank's rows, or its CP share in a CP batch

    @classmethod
    def of(cls, parallel: Parallel, cp: bool = False) -> Layouts:
        sizes = token_axis_sizes(parallel, cp)
        dp, cpx, ts = TokenAxis.ATTN_DP, TokenAxis.ATTN_CP, TokenAxis.ATTN_TP_SCATTER
        return cls(REPLICATED, Layout.of(dp, sizes=sizes), Layout.of(dp, cpx, ts, sizes=sizes),
                   Layout.of(dp, cpx, sizes=sizes))

    def residual(self, mode: RowMode) -> Layout:
        """Where the residual lives between stages in ``mode``."""
        return self.attention if mode is RowMode.AR else self.scattered
