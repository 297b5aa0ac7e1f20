"""The primitives that move token rows: each way of moving rows named once, with what it does,
the collectives it issues (what the ledger must record) and whether it allocates, side by
side. Tensors hold real rows only; a fixed-size collective pads inside itself and the ledger
records the padded size it moves. ``ops.TRANSITIONS`` chooses among them.
"""

from __future__ import annotations

import torch

from .layout import RowMode
from .row_facts import RowFacts
from .runtime import collectives as coll
from .runtime.parallel import Group


def _one(kind: str, group: Group, rows: int, width: int) -> list:
    """The ledger entry of one collective over ``group`` of ``rows`` rows (none where the
    group has one rank or nobody holds a row: the collective short-circuits)."""
    return [(kind, group.name, rows * width)] if group.size > 1 and rows else []


class Primitive:
    """One way of moving rows: its movement, the collectives it issues, whether it allocates.

    ``move(facts, x)`` moves ``x``; ``expected(facts, width)`` is what the ledger records for
    ``width``-wide rows, [(kind, group, logical elements)]; ``name`` is how plans print it
    ("{v}" becomes "_v" in rsv, where it moves variable-size blocks).
    """

    name = ""
    allocates = False  # returns storage nothing else holds (a gather), never an alias

    def move(self, facts: RowFacts, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def expected(self, facts: RowFacts, width: int) -> list:
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Identity(Primitive):
    name = "-"

    def move(self, facts, x):
        return x


class SliceDp(Primitive):
    name = "slice(dp)"

    def move(self, facts, x):
        if facts.attn_dp == 1:
            return x
        return x[facts.offset:facts.offset + facts.local]


class SliceScatter(Primitive):
    name = "slice(attn_tp)"

    def move(self, facts, x):
        if facts.attn_tp == 1:
            return x
        return x[facts.scatter_offset:facts.scatter_offset + facts.scattered]


class SliceDpScatter(Primitive):
    name = "slice(tp)"

    def move(self, facts, x):
        return SLICE_SCATTER.move(facts, SLICE_DP.move(facts, x))


class GatherScatter(Primitive):
    name, allocates = "all_gather{v}(attn_tp)", True

    def move(self, facts, x):
        group = facts.parallel.attn_tp_group
        if facts.mode is RowMode.RS:
            return coll.gather_rows(facts.pad(x, facts.chunk), group)[: facts.share]
        return coll.gather_rows_v(x, group, facts.segment_sizes)

    def expected(self, facts, width):
        fixed = facts.mode is RowMode.RS
        return _one("all_gather", facts.parallel.attn_tp_group,
                    facts.padded_local if fixed else facts.share, width)


class GatherDp(Primitive):
    name, allocates = "all_gather_v(attn_dp)", True

    def move(self, facts, x):
        return coll.gather_rows_v(x, facts.parallel.attn_dp_group, facts.counts)

    def expected(self, facts, width):
        return _one("all_gather", facts.parallel.attn_dp_group, facts.total, width)


class GatherDpScatter(Primitive):
    name, allocates = "all_gather{v}(tp)", True

    def move(self, facts, x):
        group = facts.parallel.tp_group
        if facts.mode is RowMode.RS:
            if group.size == 1:
                return x
            gathered = coll.gather_rows(facts.pad(x, facts.chunk), group)
            return gathered.index_select(0, facts.pad_index.to(x.device))
        return coll.gather_rows_v(x, group, facts.scatter_sizes)

    def expected(self, facts, width):
        fixed = facts.mode is RowMode.RS
        return _one("all_gather", facts.parallel.tp_group,
                    facts.padded_total if fixed else facts.total, width)


class AllReduceAttnTp(Primitive):
    name = "all_reduce(attn_tp)"

    def move(self, facts, x):
        return coll.all_reduce_rows(x, facts.parallel.attn_tp_group)

    def expected(self, facts, width):
        return _one("all_reduce", facts.parallel.attn_tp_group, facts.share, width)


class ReduceScatterAttnTp(Primitive):
    name = "reduce_scatter{v}(attn_tp)"

    def move(self, facts, x):
        group = facts.parallel.attn_tp_group
        if facts.mode is RowMode.RS:
            out = coll.reduce_scatter_rows(facts.pad(x, facts.padded_local), group)
            return out[: facts.scattered]
        return coll.reduce_scatter_rows_v(x, group, facts.segment_sizes)

    def expected(self, facts, width):
        fixed = facts.mode is RowMode.RS
        return _one("reduce_scatter", facts.parallel.attn_tp_group,
                    facts.padded_local if fixed else facts.share, width)


class AllReduceTpDpPlaced(Primitive):
    name, allocates = "all_reduce(tp)", True

    def move(self, facts, x):
        if facts.parallel.tp_group.size == 1:
            return x
        buffer = x.new_zeros((facts.total, *x.shape[1:]))
        buffer[facts.offset:facts.offset + facts.local] = x
        return coll.all_reduce_rows(buffer, facts.parallel.tp_group)

    def expected(self, facts, width):
        return _one("all_reduce", facts.parallel.tp_group, facts.total, width)


class AllReduceTp(Primitive):
    name = "all_reduce(tp)"

    def move(self, facts, x):
        return coll.all_reduce_rows(x, facts.parallel.tp_group)

    def expected(self, facts, width):
        return _one("all_reduce", facts.parallel.tp_group, facts.total, width)


class AllReduceTpSliceDp(Primitive):
    name = "all_reduce(tp)+slice(dp)"

    def move(self, facts, x):
        return SLICE_DP.move(facts, coll.all_reduce_rows(x, facts.parallel.tp_group))

    def expected(self, facts, width):
        return _one("all_reduce", facts.parallel.tp_group, facts.total, width)


class ReduceScatterTp(Primitive):
    name = "reduce_scatter{v}(tp)"

    def move(self, facts, x):
        group = facts.parallel.tp_group
        if facts.mode is RowMode.RS:
            if group.size == 1:
                return x
            return coll.reduce_scatter_rows(facts.pad_global(x), group)[: facts.scattered]
        return coll.reduce_scatter_rows_v(x, group, facts.scatter_sizes)

    def expected(self, facts, width):
        fixed = facts.mode is RowMode.RS
        return _one("reduce_scatter", facts.parallel.tp_group,
                    facts.padded_total if fixed else facts.total, width)


# -- a CP batch: this DP rank's tokens (local rows, token order) and its CP shares

def _unpermute(gathered: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows gathered in ``order`` (the row each came from), back in row order."""
    return torch.empty_like(gathered).index_copy_(0, order.to(gathered.device), gathered)


class SliceCp(Primitive):
    name = "select(attn_cp)"

    def move(self, facts, x):
        return x.index_select(0, facts.cp_index.to(x.device))


class GatherShares(Primitive):
    """Shares gathered over one group (each rank's rows in mapping order) and put back in
    token order: over ``attn_cp``, a DP rank's tokens; over ``dp_cp``, the global rows.
    Which facts size and order them is named once, at the instance."""

    allocates = True

    def __init__(self, group: str, sizes: str, order: str, rows: str) -> None:
        self.group, self.sizes, self.order, self.rows = group, sizes, order, rows
        self.name = f"all_gather_v({group})"

    def move(self, facts, x):
        gathered = coll.gather_rows_v(x, getattr(facts.parallel, f"{self.group}_group"),
                                      getattr(facts, self.sizes))
        return _unpermute(gathered, getattr(facts, self.order))

    def expected(self, facts, width):
        return _one("all_gather", getattr(facts.parallel, f"{self.group}_group"),
                    getattr(facts, self.rows), width)

    def __repr__(self) -> str:
        return f"GatherShares({self.group!r})"


class SliceCpScatter(Primitive):
    name = "select(attn_cp)+slice(attn_tp)"

    def move(self, facts, x):
        start = facts.scatter_offset
        return x.index_select(0, facts.cp_index[start:start + facts.scattered].to(x.device))


class Then(Primitive):
    """One primitive, then another on its result: the name, the collectives and whether it
    allocates follow from the two."""

    def __init__(self, first: Primitive, second: Primitive) -> None:
        self.first, self.second = first, second
        self.name = f"{first.name}+{second.name}"
        self.allocates = first.allocates or second.allocates

    def move(self, facts, x):
        return self.second.move(facts, self.first.move(facts, x))

    def expected(self, facts, width):
        return self.first.expected(facts, width) + self.second.expected(facts, width)

    def __repr__(self) -> str:
        return f"Then({self.first!r}, {self.second!r})"


class GatherPartsScatter(Primitive):
    name, allocates = "all_gather{v}(tp)", True

    def move(self, facts, x):
        group = facts.parallel.tp_group
        if facts.mode is RowMode.RS:
            gathered = coll.gather_rows(facts.pad(x, facts.chunk), group)
            return gathered.index_select(0, facts.pad_pos.to(x.device))
        gathered = coll.gather_rows_v(x, group, facts.scatter_sizes)
        return _unpermute(gathered, facts.global_order)

    def expected(self, facts, width):
        return GATHER_DP_SCATTER.expected(facts, width)


class SelectShare(Primitive):
    name = "select(dp_cp)"

    def move(self, facts, x):
        return x.index_select(0, facts.share_global.to(x.device))


class SelectShareScatter(Primitive):
    name = "select(dp_cp)+slice(attn_tp)"

    def move(self, facts, x):
        start = facts.scatter_offset
        rows = facts.share_global[start:start + facts.scattered]
        return x.index_select(0, rows.to(x.device))


class ReduceScatterParts(Primitive):
    name = "reduce_scatter{v}(tp)"

    def move(self, facts, x):
        group = facts.parallel.tp_group
        if facts.mode is RowMode.RS:  # each global row at its padded place, then fixed blocks
            padded = x.new_zeros((facts.padded_total, *x.shape[1:]))
            padded.index_copy_(0, facts.pad_pos.to(x.device), x)
            return coll.reduce_scatter_rows(padded, group)[: facts.scattered]
        in_parts = x.index_select(0, facts.global_order.to(x.device))  # partition order
        return coll.reduce_scatter_rows_v(in_parts, group, facts.scatter_sizes)

    def expected(self, facts, width):
        return REDUCE_SCATTER_TP.expected(facts, width)


IDENTITY, SLICE_DP, SLICE_SCATTER = Identity(), SliceDp(), SliceScatter()
SLICE_DP_SCATTER = SliceDpScatter()
GATHER_SCATTER, GATHER_DP, GATHER_DP_SCATTER = GatherScatter(), GatherDp(), GatherDpScatter()
ALL_REDUCE_ATTN_TP, REDUCE_SCATTER_ATTN_TP = AllReduceAttnTp(), ReduceScatterAttnTp()
ALL_REDUCE_TP_DP_PLACED, ALL_REDUCE_TP = AllReduceTpDpPlaced(), AllReduceTp()
ALL_REDUCE_TP_SLICE_DP, REDUCE_SCATTER_TP = AllReduceTpSliceDp(), ReduceScatterTp()
SLICE_CP = SliceCp()
# a DP rank's tokens from its CP shares; the global rows from every (DP, CP) share
GATHER_CP = GatherShares("attn_cp", sizes="cp_sizes", order="cp_order", rows="local")
SLICE_CP_SCATTER, GATHER_CP_SCATTER = SliceCpScatter(), Then(GATHER_SCATTER, GATHER_CP)
GATHER_PARTS = GatherShares("dp_cp", sizes="parts", order="global_order", rows="total")
GATHER_PARTS_SCATTER = GatherPartsScatter()
SELECT_SHARE, SELECT_SHARE_SCATTER = SelectShare(), SelectShareScatter()
ALL_REDUCE_ATTN_TP_GATHER_CP = Then(ALL_REDUCE_ATTN_TP, GATHER_CP)
ALL_REDUCE_TP_SELECT_SHARE = Then(ALL_REDUCE_TP, SELECT_SHARE)
REDUCE_SCATTER_PARTS = ReduceScatterParts()
