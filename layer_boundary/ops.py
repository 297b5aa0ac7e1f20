"""Token-row movements: the primitives that move rows, one table of supported transitions, and
the row facts a forward's movements run on.

A movement takes a value on a source layout, owing a sum or nothing, to a destination layout.
Each way of moving rows is one ``Primitive`` object, named once, with its run, the collectives
it issues (what the ledger must record) and whether it allocates, side by side.
``TRANSITIONS`` is the only place a movement is chosen: each row names the sum it completes,
the token axes it gathers and scatters, the row modes it serves, its primitive and its row
contract. A ``MovementTable`` resolves the rows against one topology and row mode at
construction; a pair it does not hold has no implementation and is rejected there. Nothing
here runs per forward except the primitives (and a cached lookup of the forward's row facts).

Row order: the global batch is the attention-DP ranks' tokens in DP rank order; a DP rank's
rows are cut over attention TP in TP rank order, in ``rs`` as equal chunks of
ceil(max rows / attn_tp) (the last ranks may hold fewer, or none) and in ``rsv`` as balanced
slices (the first ranks take the remainder). Tensors hold real rows only; a fixed-size
collective pads inside itself and the ledger records the padded size it moves.

Adding a transition is adding one ``Primitive`` (if no existing one moves the rows) and one
row of ``TRANSITIONS``; the table test runs every row on real ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .layout import Layout, Layouts, RowMode, SumGroup, TokenAxis
from .runtime import collectives as coll
from .runtime.parallel import Group, Parallel


class UnsupportedBoundary(ValueError):
    """A transition this package has no correct implementation for."""


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
                 table: "MovementTable | None" = None, request_lens=None) -> None:
        dims = parallel.dims
        if len(counts) != dims.attn_dp:
            raise ValueError(f"the batch has {len(counts)} DP token counts but attn_dp is "
                             f"{dims.attn_dp}")
        self.mode, self.counts, self.parallel = mode, tuple(counts), parallel
        self.table = table if table is not None else movement_table(
            parallel, mode, cp=request_lens is not None)
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

    def move(self, owed: SumGroup | None, src: Layout, dst: Layout) -> "Movement":
        """The prebuilt movement for (owed, src, dst) in this forward's mode."""
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


def _one(kind: str, group: Group, rows: int, width: int) -> list:
    """The ledger entry of one collective over ``group`` of ``rows`` rows (none where the
    group has one rank or nobody holds a row: the collective short-circuits)."""
    return [(kind, group.name, rows * width)] if group.size > 1 and rows else []


class Primitive:
    """One way of moving rows: its run, the collectives it issues, whether it allocates.

    ``run(facts, x)`` moves ``x``; ``expected(facts, width)`` is what the ledger records for
    ``width``-wide rows, [(kind, group, logical elements)]; ``name`` is how plans print it
    ("{v}" becomes "_v" in rsv, where it moves variable-size blocks).
    """

    name = ""
    allocates = False  # returns storage nothing else holds (a gather), never an alias

    def run(self, facts: RowFacts, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def expected(self, facts: RowFacts, width: int) -> list:
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Identity(Primitive):
    name = "-"

    def run(self, facts, x):
        return x


class SliceDp(Primitive):
    name = "slice(dp)"

    def run(self, facts, x):
        if facts.attn_dp == 1:
            return x
        return x[facts.offset:facts.offset + facts.local]


class SliceScatter(Primitive):
    name = "slice(attn_tp)"

    def run(self, facts, x):
        if facts.attn_tp == 1:
            return x
        return x[facts.scatter_offset:facts.scatter_offset + facts.scattered]


class SliceDpScatter(Primitive):
    name = "slice(tp)"

    def run(self, facts, x):
        return SLICE_SCATTER.run(facts, SLICE_DP.run(facts, x))


class GatherScatter(Primitive):
    name, allocates = "all_gather{v}(attn_tp)", True

    def run(self, facts, x):
        group = facts.parallel.attn_tp
        if facts.mode is RowMode.RS:
            return coll.gather_rows(facts.pad(x, facts.chunk), group)[: facts.share]
        return coll.gather_rows_v(x, group, facts.segment_sizes)

    def expected(self, facts, width):
        fixed = facts.mode is RowMode.RS
        return _one("all_gather", facts.parallel.attn_tp,
                    facts.padded_local if fixed else facts.share, width)


class GatherDp(Primitive):
    name, allocates = "all_gather_v(attn_dp)", True

    def run(self, facts, x):
        return coll.gather_rows_v(x, facts.parallel.attn_dp, facts.counts)

    def expected(self, facts, width):
        return _one("all_gather", facts.parallel.attn_dp, facts.total, width)


class GatherDpScatter(Primitive):
    name, allocates = "all_gather{v}(tp)", True

    def run(self, facts, x):
        group = facts.parallel.tp
        if facts.mode is RowMode.RS:
            if group.size == 1:
                return x
            gathered = coll.gather_rows(facts.pad(x, facts.chunk), group)
            return gathered.index_select(0, facts.pad_index.to(x.device))
        return coll.gather_rows_v(x, group, facts.scatter_sizes)

    def expected(self, facts, width):
        fixed = facts.mode is RowMode.RS
        return _one("all_gather", facts.parallel.tp,
                    facts.padded_total if fixed else facts.total, width)


class AllReduceAttnTp(Primitive):
    name = "all_reduce(attn_tp)"

    def run(self, facts, x):
        return coll.all_reduce_rows(x, facts.parallel.attn_tp)

    def expected(self, facts, width):
        return _one("all_reduce", facts.parallel.attn_tp, facts.share, width)


class ReduceScatterAttnTp(Primitive):
    name = "reduce_scatter{v}(attn_tp)"

    def run(self, facts, x):
        group = facts.parallel.attn_tp
        if facts.mode is RowMode.RS:
            out = coll.reduce_scatter_rows(facts.pad(x, facts.padded_local), group)
            return out[: facts.scattered]
        return coll.reduce_scatter_rows_v(x, group, facts.segment_sizes)

    def expected(self, facts, width):
        fixed = facts.mode is RowMode.RS
        return _one("reduce_scatter", facts.parallel.attn_tp,
                    facts.padded_local if fixed else facts.share, width)


class AllReduceTpDpPlaced(Primitive):
    name, allocates = "all_reduce(tp)", True

    def run(self, facts, x):
        if facts.parallel.tp.size == 1:
            return x
        buffer = x.new_zeros((facts.total, *x.shape[1:]))
        buffer[facts.offset:facts.offset + facts.local] = x
        return coll.all_reduce_rows(buffer, facts.parallel.tp)

    def expected(self, facts, width):
        return _one("all_reduce", facts.parallel.tp, facts.total, width)


class AllReduceTp(Primitive):
    name = "all_reduce(tp)"

    def run(self, facts, x):
        return coll.all_reduce_rows(x, facts.parallel.tp)

    def expected(self, facts, width):
        return _one("all_reduce", facts.parallel.tp, facts.total, width)


class AllReduceTpSliceDp(Primitive):
    name = "all_reduce(tp)+slice(dp)"

    def run(self, facts, x):
        return SLICE_DP.run(facts, coll.all_reduce_rows(x, facts.parallel.tp))

    def expected(self, facts, width):
        return _one("all_reduce", facts.parallel.tp, facts.total, width)


class ReduceScatterTp(Primitive):
    name = "reduce_scatter{v}(tp)"

    def run(self, facts, x):
        group = facts.parallel.tp
        if facts.mode is RowMode.RS:
            if group.size == 1:
                return x
            return coll.reduce_scatter_rows(facts.pad_global(x), group)[: facts.scattered]
        return coll.reduce_scatter_rows_v(x, group, facts.scatter_sizes)

    def expected(self, facts, width):
        fixed = facts.mode is RowMode.RS
        return _one("reduce_scatter", facts.parallel.tp,
                    facts.padded_total if fixed else facts.total, width)


# -- a CP batch: this DP rank's tokens (local rows, token order) and its CP shares

def _unpermute(gathered: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows gathered in ``order`` (the row each came from), back in row order."""
    return torch.empty_like(gathered).index_copy_(0, order.to(gathered.device), gathered)


class SliceCp(Primitive):
    name = "select(attn_cp)"

    def run(self, facts, x):
        return x.index_select(0, facts.cp_index.to(x.device))


class GatherShares(Primitive):
    """Shares gathered over one group (each rank's rows in mapping order) and put back in
    token order: over ``attn_cp``, a DP rank's tokens; over ``dp_cp``, the global rows.
    Which facts size and order them is named once, at the instance."""

    allocates = True

    def __init__(self, group: str, sizes: str, order: str, rows: str) -> None:
        self.group, self.sizes, self.order, self.rows = group, sizes, order, rows
        self.name = f"all_gather_v({group})"

    def run(self, facts, x):
        gathered = coll.gather_rows_v(x, getattr(facts.parallel, self.group),
                                      getattr(facts, self.sizes))
        return _unpermute(gathered, getattr(facts, self.order))

    def expected(self, facts, width):
        return _one("all_gather", getattr(facts.parallel, self.group),
                    getattr(facts, self.rows), width)

    def __repr__(self) -> str:
        return f"GatherShares({self.group!r})"


class SliceCpScatter(Primitive):
    name = "select(attn_cp)+slice(attn_tp)"

    def run(self, facts, x):
        start = facts.scatter_offset
        return x.index_select(0, facts.cp_index[start:start + facts.scattered].to(x.device))


class Then(Primitive):
    """One primitive, then another on its result: the name, the collectives and whether it
    allocates follow from the two."""

    def __init__(self, first: Primitive, second: Primitive) -> None:
        self.first, self.second = first, second
        self.name = f"{first.name}+{second.name}"
        self.allocates = first.allocates or second.allocates

    def run(self, facts, x):
        return self.second.run(facts, self.first.run(facts, x))

    def expected(self, facts, width):
        return self.first.expected(facts, width) + self.second.expected(facts, width)

    def __repr__(self) -> str:
        return f"Then({self.first!r}, {self.second!r})"


class GatherPartsScatter(Primitive):
    name, allocates = "all_gather{v}(tp)", True

    def run(self, facts, x):
        group = facts.parallel.tp
        if facts.mode is RowMode.RS:
            gathered = coll.gather_rows(facts.pad(x, facts.chunk), group)
            return gathered.index_select(0, facts.pad_pos.to(x.device))
        gathered = coll.gather_rows_v(x, group, facts.scatter_sizes)
        return _unpermute(gathered, facts.global_order)

    def expected(self, facts, width):
        return GATHER_DP_SCATTER.expected(facts, width)


class SelectShare(Primitive):
    name = "select(dp_cp)"

    def run(self, facts, x):
        return x.index_select(0, facts.share_global.to(x.device))


class SelectShareScatter(Primitive):
    name = "select(dp_cp)+slice(attn_tp)"

    def run(self, facts, x):
        start = facts.scatter_offset
        rows = facts.share_global[start:start + facts.scattered]
        return x.index_select(0, rows.to(x.device))


class ReduceScatterParts(Primitive):
    name = "reduce_scatter{v}(tp)"

    def run(self, facts, x):
        group = facts.parallel.tp
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


@dataclass(frozen=True, eq=False)
class Movement:
    """One resolved row of the table: how a value reaches ``dst`` from ``src`` in one mode."""

    name: str  # as plans print it, e.g. "reduce_scatter_v(tp)"
    owed: SumGroup | None
    src: Layout
    dst: Layout
    primitive: Primitive
    contract: str  # its row contract, one line
    # every group of the topology has one rank: the primitive would return its input, so
    # callers skip it (decided once, at construction)
    alone: bool = False
    run: object = field(init=False, repr=False)  # the primitive's run, bound once
    moves: bool = field(init=False, repr=False)  # False for the identity: callers skip it

    def __post_init__(self) -> None:
        object.__setattr__(self, "run", self.primitive.run)
        object.__setattr__(self, "moves", self.primitive is not IDENTITY and not self.alone)

    @property
    def allocates(self) -> bool:
        """Whether its result is new storage (never where nothing moves)."""
        return self.moves and self.primitive.allocates

    def __call__(self, facts: RowFacts, x: torch.Tensor) -> torch.Tensor:
        return self.run(facts, x)

    def expected(self, facts: RowFacts, width: int) -> list[tuple[str, str, int]]:
        return self.primitive.expected(facts, width)


DP, CP, TS = TokenAxis.ATTN_DP, TokenAxis.ATTN_CP, TokenAxis.ATTN_TP_SCATTER
ALL_MODES = frozenset(RowMode)
SCATTERING = frozenset({RowMode.RS, RowMode.RSV})
TP_SUMS = frozenset({SumGroup.TP, SumGroup.MOE_OUT})


@dataclass(frozen=True)
class Transition:
    """A row of the table: a value owing one of ``owed`` (None: nothing), on a layout that
    loses ``gathers`` and gains ``scatters``, in one of ``modes``, moved by ``primitive``."""

    owed: frozenset
    gathers: frozenset
    scatters: frozenset
    modes: frozenset
    primitive: Primitive
    contract: str
    # the named layout (Layouts field) the value must be on: a partial sums over the ranks
    # that hold the same rows, so its rows are fixed by the group it owes
    source: str | None = None
    needs_scattered_target: bool = False  # only onto the scattered residual layout

    def matches(self, owed, src: Layout, dst: Layout, mode: RowMode, layouts: Layouts) -> bool:
        return (owed in self.owed and mode in self.modes
                and src.sharded - dst.sharded == self.gathers
                and dst.sharded - src.sharded == self.scatters
                and (self.source is None or src == getattr(layouts, self.source))
                and (not self.needs_scattered_target or dst == layouts.scattered))


def _t(owed, gathers, scatters, modes, primitive, contract, **kw) -> Transition:
    owed = frozenset(owed) if isinstance(owed, (set, frozenset)) else frozenset({owed})
    return Transition(owed, frozenset(gathers), frozenset(scatters), frozenset(modes),
                      primitive, contract, **kw)


TRANSITIONS: tuple[Transition, ...] = (
    # complete values: slices are free, gathers allocate
    _t(None, (), (), ALL_MODES, IDENTITY, "rows unchanged"),
    _t(None, (), (DP,), ALL_MODES, SLICE_DP, "this DP rank's segment of the global rows"),
    _t(None, (), (TS,), SCATTERING, SLICE_SCATTER,
       "this attention-TP rank's slice of its DP rank's rows"),
    _t(None, (), (DP, TS), SCATTERING, SLICE_DP_SCATTER,
       "this rank's slice of its DP rank's segment of the global rows"),
    _t(None, (TS,), (), SCATTERING, GATHER_SCATTER,
       "the DP rank's rows from its attention-TP slices, in TP rank order"),
    _t(None, (DP,), (), ALL_MODES, GATHER_DP, "every DP rank's rows, in DP rank order"),
    _t(None, (DP, TS), (), SCATTERING, GATHER_DP_SCATTER,
       "every rank's slice, in TP rank order: the global rows"),
    # an attention partial: summed over attention TP on its attention rows
    _t(SumGroup.ATTN_TP, (), (), ALL_MODES, ALL_REDUCE_ATTN_TP,
       "rows unchanged, summed over attention TP", source="attention"),
    _t(SumGroup.ATTN_TP, (), (TS,), SCATTERING, REDUCE_SCATTER_ATTN_TP,
       "each attention-TP rank gets the sum of its slice", source="attention"),
    _t(SumGroup.ATTN_TP, (DP,), (), {RowMode.AR}, ALL_REDUCE_TP_DP_PLACED,
       "each DP rank's partial placed in a zero global buffer and summed over TP: the sum "
       "and the DP gather in one collective", source="attention"),
    # a TP-group partial on the global rows
    _t(TP_SUMS, (), (), ALL_MODES, ALL_REDUCE_TP, "global rows unchanged, summed over TP",
       source="replicated"),
    _t(TP_SUMS, (), (DP,), SCATTERING, REDUCE_SCATTER_TP,
       "each rank gets the sum of its DP rank's rows", source="replicated",
       needs_scattered_target=True),
    _t(TP_SUMS, (), (DP,), ALL_MODES, ALL_REDUCE_TP_SLICE_DP,
       "summed over TP, then this DP rank's segment", source="replicated"),
    _t(TP_SUMS, (), (TS,), SCATTERING, REDUCE_SCATTER_TP,
       "each rank gets the sum of its slice", source="replicated"),
    _t(TP_SUMS, (), (DP, TS), SCATTERING, REDUCE_SCATTER_TP,
       "each rank gets the sum of its slice of its DP rank's rows", source="replicated"),
)


# A CP batch: the attention rows are this CP rank's share of its DP rank's tokens (CP and,
# under attention DP, DP partition them); local rows are the DP rank's tokens in token order
# and the global rows every DP rank's, each in token order (as without CP).
_CP_PARTS = ((DP, CP), (CP,))  # what separates a share from the global rows (DP, or not)
TRANSITIONS += (
    _t(None, (), (CP,), ALL_MODES, SLICE_CP, "this CP rank's share of its DP rank's tokens, in "
       "share order (cp_shares)"),
    _t(None, (CP,), (), ALL_MODES, GATHER_CP, "the DP rank's tokens from its CP ranks' shares, "
       "back in token order"),
    _t(None, (), (CP, TS), SCATTERING, SLICE_CP_SCATTER, "this rank's attention-TP slice of its "
       "CP share"),
    _t(None, (CP, TS), (), SCATTERING, GATHER_CP_SCATTER, "the DP rank's tokens from every "
       "attention-TP slice of every CP share, in token order"),
    _t(None, (DP, CP), (), ALL_MODES, GATHER_PARTS, "every (DP, CP) rank's share, gathered in "
       "partition order, back in global token order"),
    _t(None, (DP, CP, TS), (), SCATTERING, GATHER_PARTS_SCATTER, "every rank's slice of its "
       "share, back in global token order"),
    _t(None, (), (DP, CP), ALL_MODES, SELECT_SHARE, "this rank's share of the global rows"),
    _t(None, (), (DP, CP, TS), SCATTERING, SELECT_SHARE_SCATTER, "this rank's slice of its "
       "share of the global rows"),
    _t(SumGroup.ATTN_TP, (CP,), (), ALL_MODES, ALL_REDUCE_ATTN_TP_GATHER_CP, "summed over "
       "attention TP on the share, then the DP rank's tokens in token order",
       source="attention"),
) + tuple(
    row for parts in _CP_PARTS for row in (
        _t(TP_SUMS, (), parts, SCATTERING, REDUCE_SCATTER_PARTS, "the global rows summed over "
           "TP, each rank getting its share (reduce-scatter over dp x cp x attn_tp in partition "
           "order)", source="replicated", needs_scattered_target=True),
        _t(TP_SUMS, (), parts, ALL_MODES, ALL_REDUCE_TP_SELECT_SHARE, "summed over TP, then "
           "this rank's share", source="replicated"),
        _t(TP_SUMS, (), (*parts, TS), SCATTERING, REDUCE_SCATTER_PARTS, "each rank gets the "
           "sum of its slice of its share", source="replicated"),
    ))


def _name(primitive: Primitive, mode: RowMode) -> str:
    return primitive.name.replace("{v}", "_v" if mode is RowMode.RSV else "")


def _no_movement(owed, src: Layout, dst: Layout, mode: RowMode) -> str:
    what = f"a sum over {owed.value}" if owed is not None else "a complete value"
    return f"no row movement takes {what} on {src} rows to {dst} rows in {mode.value} mode"


def resolve(owed, src: Layout, dst: Layout, mode: RowMode, layouts: Layouts,
            alone: bool = False) -> Movement | None:
    """The table's movement for this pair, or None when it holds none (``alone``: on a
    one-rank topology, where it moves nothing)."""
    for row in TRANSITIONS:
        if row.matches(owed, src, dst, mode, layouts):
            return Movement(_name(row.primitive, mode), owed, src, dst, row.primitive,
                            row.contract, alone)
    return None


class MovementTable:
    """Every supported (owed, src, dst) of one topology, row mode and batch variant (``cp``:
    a CP batch), resolved once, and the row facts of the forwards that use it (kept by DP
    token counts, and in a CP batch every DP rank's request lengths)."""

    FACTS_KEPT = 256  # distinct batch shapes remembered (a serving loop's)

    def __init__(self, parallel: Parallel, mode: RowMode, cp: bool = False) -> None:
        self.parallel, self.mode, self.cp = parallel, mode, cp
        self.layouts = layouts = Layouts.of(parallel, cp)
        # an ordered list, not a set: every rank must see the table in one order
        named = [layouts.replicated, layouts.local, layouts.attention]
        if mode is not RowMode.AR:
            named.append(layouts.scattered)
        names = list(dict.fromkeys(named))
        self._moves: dict[tuple, Movement] = {}
        for owed in (None, *SumGroup):
            for src in names:
                for dst in names:
                    movement = resolve(owed, src, dst, mode, layouts,
                                       alone=parallel.tp.size == 1)
                    if movement is not None:
                        self._moves[(owed, src.key, dst.key)] = movement
        self._facts: dict[tuple, RowFacts] = {}

    def lookup(self, owed, src: Layout, dst: Layout) -> Movement:
        """The movement for a value owing ``owed`` from ``src`` to ``dst``, or the
        construction-time rejection naming the pair."""
        movement = self._moves.get((owed, src.key, dst.key))
        if movement is None:
            raise UnsupportedBoundary(_no_movement(owed, src, dst, self.mode))
        return movement

    def __contains__(self, key) -> bool:
        return key in self._moves

    def items(self):
        """(owed, src key, dst key) -> Movement, in the table's one order."""
        return self._moves.items()

    def facts(self, counts: tuple[int, ...], request_lens=None) -> RowFacts:
        """The row facts of a forward with these DP token counts (and, in a CP batch, every
        DP rank's request lengths), built once per batch shape."""
        key = counts if request_lens is None else (counts, request_lens)
        facts = self._facts.get(key)
        if facts is None:
            if len(self._facts) >= self.FACTS_KEPT:
                self._facts.pop(next(iter(self._facts)))
            facts = self._facts[key] = RowFacts(self.mode, counts, self.parallel, self,
                                                request_lens)
        return facts

    def rows(self) -> list[dict]:
        """The table as printable rows (for ``plan`` and tests)."""
        return [{"owed": None if m.owed is None else m.owed.value, "from": str(m.src),
                 "to": str(m.dst), "movement": m.name, "contract": m.contract}
                for m in self._moves.values()]


@functools.lru_cache(maxsize=None)
def movement_table(parallel: Parallel, mode: RowMode, cp: bool = False) -> MovementTable:
    """The table of one topology, mode and variant (resolved once per topology: a memo)."""
    return MovementTable(parallel, mode, cp)


def table_rows(parallel: Parallel, mode: RowMode, cp: bool = False) -> list[dict]:
    """The resolved table as printable rows (for ``plan`` and tests)."""
    return movement_table(parallel, mode, cp).rows()
