"""A forward's row facts: how many rows each layout holds on this rank, where they sit in the
global batch, how ``rs``/``rsv`` cut them over attention TP, and a CP batch's shares.

Row order: the global batch is the attention-DP ranks' tokens in DP rank order; a DP rank's
rows are cut over attention TP in TP rank order, in ``rs`` as equal chunks of
ceil(max rows / attn_tp) (the last ranks may hold fewer, or none) and in ``rsv`` as balanced
slices (the first ranks take the remainder).
"""

from __future__ import annotations

import torch

from .contracts import UnsupportedBoundary
from .layout import Layout, RowMode, SumGroup
from .runtime.parallel import Parallel


def split_rows(n: int, parts: int) -> tuple[int, ...]:
    """Real rows per part when ``n`` rows are split in order over ``parts`` ranks (balanced)."""
    return tuple(n // parts + (1 if i < n % parts else 0) for i in range(parts))


def chunk_rows(n: int, chunk: int, parts: int) -> tuple[int, ...]:
    """Real rows per part when ``n`` rows are cut in order into chunks of ``chunk`` rows."""
    return tuple(max(0, min(chunk, n - i * chunk)) for i in range(parts))


def cp_shares(lens, cp: int) -> tuple[tuple[int, ...], ...]:
    """Each CP rank's share of one DP rank's tokens (its requests ``lens`` concatenated), as
    token indices in share order: every request cut into 2 x cp contiguous chunks (balanced,
    the first chunks taking the remainder), CP rank r taking chunks r and 2cp-1-r of each
    request, requests in order. An early chunk with a late one gives every rank about the
    same causal attention work; a request shorter than 2 x cp leaves some ranks none of it.
    """
    shares = [[] for _ in range(cp)]
    offset = 0
    for n in lens:
        sizes = split_rows(n, 2 * cp)
        starts = [offset + sum(sizes[:j]) for j in range(2 * cp)]
        for r in range(cp):
            for j in (r, 2 * cp - 1 - r):
                shares[r].extend(range(starts[j], starts[j] + sizes[j]))
        offset += n
    return tuple(tuple(s) for s in shares)


def cp_share_sizes(lens, cp: int) -> tuple[int, ...]:
    """How many tokens each CP rank's share of ``cp_shares(lens, cp)`` holds."""
    sizes = [0] * cp
    for n in lens:
        chunks = split_rows(n, 2 * cp)
        for r in range(cp):
            sizes[r] += chunks[r] + chunks[2 * cp - 1 - r]
    return tuple(sizes)


class RowFacts:
    """One forward's rows on this rank: how many each layout holds, where they sit in the
    global batch, how ``rs``/``rsv`` cut them over attention TP, and in a CP batch which of
    its DP rank's tokens this CP rank holds.

    Built complete from the batch's DP token counts (and, in a CP batch, every DP rank's
    request lengths: the CP mapping, ``cp_shares``); every rank agrees on them, so every rank
    sizes its collectives identically, ranks with no tokens included. Never changed; the
    movement table keeps them by counts, so a forward with counts seen before reuses them.

    The global rows are the DP ranks' tokens in DP rank order, each in token order. The
    attention rows are partitions of them: the DP ranks' tokens (``parts`` = counts), or in a
    CP batch each (DP, CP) rank's share, DP-major (the order gathers over partitions return).
    """

    def __init__(self, mode: RowMode, counts: tuple[int, ...], parallel: Parallel,
                 table, request_lens=None) -> None:
        """Built by ``MovementTable.facts`` (``ops.row_facts`` for a mode and counts)."""
        dims = parallel.dims
        if len(counts) != dims.attn_dp:
            raise ValueError(f"the batch has {len(counts)} DP token counts but attn_dp is "
                             f"{dims.attn_dp}")
        self.mode, self.counts, self.parallel = mode, tuple(counts), parallel
        self.table = table
        self.layouts = self.table.layouts
        a, d = dims.attn_tp, parallel.attn_dp_rank
        self.attn_tp, self.attn_dp, self.dp_rank, self.tp_rank = a, dims.attn_dp, d, \
            parallel.attn_tp_rank
        self.total, self.local = sum(counts), counts[d]
        self.offset = sum(counts[:d])  # this DP rank's tokens in the global rows
        if self.table.cp:
            self._place_cp(request_lens, dims.attn_cp, parallel.attn_cp_rank)
        else:
            self.parts, self.part = self.counts, d
            self.global_order = None  # partitions in order are the global rows
        self.nparts = len(self.parts)
        self.share = self.parts[self.part]  # this rank's attention rows
        self.part_offset = sum(self.parts[: self.part])
        # rs: every partition cut in chunks of one size, so fixed-size collectives line up
        self.chunk = -(-max(self.parts) // a) if self.parts else 0
        if mode is RowMode.RS:
            per_part = [chunk_rows(c, self.chunk, a) for c in self.parts]
        else:
            per_part = [split_rows(c, a) for c in self.parts]
        self.scatter_sizes = tuple(n for sizes in per_part for n in sizes)  # flat over TP ranks
        self.segment_sizes = per_part[self.part]  # this partition's rows per attention-TP rank
        self.scattered = self.segment_sizes[self.tp_rank]
        self.scatter_offset = sum(self.segment_sizes[: self.tp_rank])
        self.padded_local = self.chunk * a  # what fixed-size collectives move
        self.padded_total = self.padded_local * self.nparts
        seg = self.padded_local
        # padded position of each row in partition order (every partition padded to attn_tp
        # chunks), and of each global row
        self.pad_index = torch.cat([torch.arange(c) + i * seg for i, c in enumerate(self.parts)]) \
            if self.parts else torch.zeros(0, dtype=torch.long)
        self.pad_pos = self.pad_index if self.global_order is None else \
            torch.empty_like(self.pad_index).index_copy_(0, self.global_order, self.pad_index)

    def _place_cp(self, request_lens, cp: int, cp_rank: int) -> None:
        shares = [cp_shares(lens, cp) for lens in request_lens]
        self.parts = tuple(len(s) for per_dp in shares for s in per_dp)
        self.part = self.dp_rank * cp + cp_rank
        mine = shares[self.dp_rank]
        self.cp_sizes = tuple(len(s) for s in mine)  # this DP rank's shares, CP rank order
        self.cp_index = torch.tensor(mine[cp_rank], dtype=torch.long)  # in its DP block
        # this DP rank's tokens in the order a gather over CP returns them
        self.cp_order = torch.tensor([i for s in mine for i in s], dtype=torch.long)
        offsets = [sum(self.counts[:k]) for k in range(len(self.counts))]
        # the global row of each row in partition order
        self.global_order = torch.tensor([offsets[k] + i for k, per_dp in enumerate(shares)
                                          for s in per_dp for i in s], dtype=torch.long)
        self.share_global = self.cp_index + self.offset  # this share's global rows

    def movement(self, owed: SumGroup | None, src: Layout, dst: Layout):
        """The prebuilt ``ops.Movement`` for (owed, src, dst) in this forward's mode (from
        ``table``, the ``ops.MovementTable`` that built these facts)."""
        return self.table.lookup(owed, src, dst)

    def count(self, layout: Layout) -> int:
        """Rows this rank holds on ``layout``."""
        if layout == self.layouts.replicated:
            return self.total
        if layout == self.layouts.local:
            return self.local
        if layout == self.layouts.attention:
            return self.share
        return self.scattered

    def global_indices(self, layout: Layout) -> torch.Tensor:
        """Global row index of each row this rank holds on ``layout``."""
        if layout == self.layouts.replicated:
            return torch.arange(self.total)
        if layout == self.layouts.local:
            return torch.arange(self.offset, self.offset + self.local)
        if self.table.cp:
            rows = self.share_global
            return rows if layout == self.layouts.attention else \
                rows[self.scatter_offset:self.scatter_offset + self.scattered]
        start = self.offset + (0 if layout == self.layouts.attention else self.scatter_offset)
        return torch.arange(start, start + self.count(layout))

    def add_on_one_rank(self, partial, layout: Layout, value):
        """``partial`` (on ``layout``, still owing a sum whose every rank holds these rows)
        with ``value`` (this DP rank's local rows, complete) added on one attention-TP rank,
        so the sum adds it exactly once. Out of place."""
        if self.tp_rank != 0:
            return partial
        value = value.to(partial.dtype)
        if layout == self.layouts.local:
            return partial + value
        if layout == self.layouts.replicated:
            start, end = self.offset, self.offset + self.local
            return partial.slice_scatter(partial[start:end] + value, 0, start, end)
        raise UnsupportedBoundary(f"a complete value cannot join a partial on {layout} rows")

    # -- padding, inside fixed-size collectives only

    @staticmethod
    def pad(x: torch.Tensor, rows: int) -> torch.Tensor:
        if x.shape[0] == rows:
            return x
        padded = x.new_zeros((rows, *x.shape[1:]))
        padded[: x.shape[0]] = x
        return padded

    def pad_global(self, x: torch.Tensor) -> torch.Tensor:
        padded = x.new_zeros((self.padded_total, *x.shape[1:]))
        return padded.index_copy_(0, self.pad_index.to(x.device), x)


BatchRows = RowFacts  # its name before it held only facts
