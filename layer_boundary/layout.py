"""Token layouts, named sum groups and the topology facts boundaries are resolved against.

A ``Layout`` says which token axes partition a rank's rows; a ``SumGroup`` says which ranks
must still be summed over. Keeping the two apart lets a contract express an unreduced
contribution and the rows its completion must land on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from . import ops
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


class Rows(enum.Enum):
    """Where a tensor's token rows are, inside one forward (padding comes from the mode)."""

    GLOBAL = "global"  # every attention-DP rank's tokens, replicated over the TP group
    LOCAL = "local"  # this DP rank's tokens, replicated over attention TP
    SCATTERED = "scattered"  # a slice of this DP rank's tokens per attention-TP rank


class RowMode(enum.Enum):
    """How a forward's residual and FFN outputs travel; one mode for every stage of a forward."""

    AR = "ar"  # residual on local rows; FFN sums by all-reduce, then a local slice
    RS = "rs"  # residual scattered in fixed-size (padded) slices; FFN sums by reduce-scatter
    RSV = "rsv"  # residual scattered in real-row slices; FFN sums by variable reduce-scatter


def split_rows(n: int, parts: int) -> tuple[int, ...]:
    """Real rows per part when ``n`` rows are split in order over ``parts`` ranks."""
    return tuple(n // parts + (1 if i < n % parts else 0) for i in range(parts))


class BatchRows:
    """One forward's row facts on this rank, and the movements between row placements.

    Built once per forward from the batch's DP token counts (every rank agrees on them), so
    every rank sizes its collectives identically, including ranks with no tokens.
    """

    def __init__(self, mode: RowMode, counts: tuple[int, ...], parallel: Parallel) -> None:
        dims = parallel.dims
        if len(counts) != dims.attn_dp:
            raise ValueError(f"the batch has {len(counts)} DP token counts but attn_dp is "
                             f"{dims.attn_dp}")
        self.mode, self.counts, self.parallel = mode, tuple(counts), parallel
        a, d = dims.attn_tp, parallel.attn_dp_rank
        self.attn_tp, self.dp_rank, self.tp_rank = a, d, parallel.attn_tp_rank
        self.total, self.local = sum(counts), counts[d]
        self.offset = sum(counts[:d])
        # RS: each DP segment padded to a multiple of attention TP, then cut in equal slices
        self.seg_pad = -(-max(counts) // a) * a if counts else 0
        self.slice_rows = self.seg_pad // a
        # RSV: each DP segment cut into real-row slices, in TP rank order (dp-major)
        self.v_sizes = tuple(split_rows(c, a) for c in counts)
        self.v_flat = tuple(n for sizes in self.v_sizes for n in sizes)
        self.v_offset = sum(self.v_sizes[d][: self.tp_rank])
        self._pad_index = None

    @property
    def scattered_rows(self) -> int:
        if self.mode is RowMode.RS:
            return self.slice_rows
        if self.mode is RowMode.RSV:
            return self.v_sizes[self.dp_rank][self.tp_rank]
        return self.local

    def global_indices(self, where: Rows) -> torch.Tensor:
        """Global row index of each row this rank holds at ``where`` (-1 for padding)."""
        if where is Rows.GLOBAL:
            return torch.arange(self.total)
        local = torch.arange(self.offset, self.offset + self.local)
        if where is Rows.LOCAL:
            return local
        if self.mode is RowMode.RS:
            padded = torch.full((self.seg_pad,), -1, dtype=torch.long)
            padded[: self.local] = local
            return padded[self.tp_rank * self.slice_rows:(self.tp_rank + 1) * self.slice_rows]
        return local[self.v_offset:self.v_offset + self.scattered_rows]

    # -- local movements (no communication)

    def pad_local(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == self.seg_pad:
            return x
        padded = x.new_zeros((self.seg_pad, *x.shape[1:]))
        padded[: x.shape[0]] = x
        return padded

    def global_to_local(self, x: torch.Tensor) -> torch.Tensor:
        """This DP rank's rows of a global tensor (the plain scatter under attention DP)."""
        if self.parallel.dims.attn_dp == 1:
            return x
        return x[self.offset:self.offset + self.local]

    def local_to_scattered(self, x: torch.Tensor) -> torch.Tensor:
        """This attention-TP rank's slice of the DP rank's rows."""
        if self.mode is RowMode.RS:
            return self.pad_local(x)[self.tp_rank * self.slice_rows:
                                     (self.tp_rank + 1) * self.slice_rows]
        return x[self.v_offset:self.v_offset + self.scattered_rows]

    def _global_pad_index(self, device) -> torch.Tensor:
        """Padded position of each global row; built once per forward, on the data's device."""
        if self._pad_index is None:
            self._pad_index = torch.cat([torch.arange(c, device=device) + i * self.seg_pad
                                         for i, c in enumerate(self.counts)])
        return self._pad_index

    def pad_global(self, x: torch.Tensor) -> torch.Tensor:
        """Global rows to [attn_dp x seg_pad] rows, each DP segment zero-padded."""
        padded = x.new_zeros((self.seg_pad * len(self.counts), *x.shape[1:]))
        return padded.index_copy_(0, self._global_pad_index(x.device), x)

    def compact_global(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, self._global_pad_index(x.device))

    # -- movements with communication (row contracts in ops.py)

    def sum_local_partial(self, x: torch.Tensor) -> torch.Tensor:
        """Local partial rows summed over attention TP onto local rows."""
        return ops.all_reduce_rows(x, self.parallel.attn_tp)

    def sum_local_partial_to_scattered(self, x: torch.Tensor) -> torch.Tensor:
        """Local partial rows summed over attention TP onto this rank's scattered slice."""
        if self.mode is RowMode.RS:
            return ops.reduce_scatter_rows(self.pad_local(x), self.parallel.attn_tp)
        return ops.reduce_scatter_rows_v(x, self.parallel.attn_tp, self.v_sizes[self.dp_rank])

    def sum_global_partial_to_local(self, x: torch.Tensor) -> torch.Tensor:
        """Global partial rows summed over TP (all-reduce), then this DP rank's slice."""
        return self.global_to_local(ops.all_reduce_rows(x, self.parallel.tp))

    def sum_global_partial_to_scattered(self, x: torch.Tensor) -> torch.Tensor:
        """Global partial rows reduce-scattered over TP onto this rank's scattered slice."""
        if self.mode is RowMode.RS:
            return ops.reduce_scatter_rows(self.pad_global(x), self.parallel.tp)
        return ops.reduce_scatter_rows_v(x, self.parallel.tp, self.v_flat)

    def sum_local_partial_to_global(self, x: torch.Tensor) -> torch.Tensor:
        """Local partial rows placed in a zero global buffer and summed over TP: each DP
        segment ends summed over its attention-TP ranks, on every rank (gather + sum in one)."""
        if self.parallel.tp.size == 1:
            return x
        buffer = x.new_zeros((self.total, *x.shape[1:]))
        buffer[self.offset:self.offset + self.local] = x
        return ops.all_reduce_rows(buffer, self.parallel.tp)

    def local_to_global(self, x: torch.Tensor) -> torch.Tensor:
        """Every DP rank's local rows, gathered in DP rank order."""
        return ops.gather_rows_v(x, self.parallel.attn_dp, self.counts)

    def scattered_to_local(self, x: torch.Tensor) -> torch.Tensor:
        """The DP rank's rows gathered from its attention-TP slices (padding dropped)."""
        if self.mode is RowMode.RS:
            return ops.gather_rows(x, self.parallel.attn_tp)[: self.local]
        return ops.gather_rows_v(x, self.parallel.attn_tp, self.v_sizes[self.dp_rank])

    def scattered_to_global(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's scattered slice gathered over TP into global rows (padding dropped)."""
        if self.mode is RowMode.RS:
            return self.compact_global(ops.gather_rows(x, self.parallel.tp))
        return ops.gather_rows_v(x, self.parallel.tp, self.v_flat)
