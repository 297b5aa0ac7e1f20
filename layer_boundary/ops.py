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


class RowFacts:
    """One forward's rows on this rank: how many each layout holds, where they sit in the
    global batch, how ``rs``/``rsv`` cut them over attention TP.

    Built complete from the batch's DP token counts (every rank agrees on them, so every rank
    sizes its collectives identically, ranks with no tokens included) and never changed; the
    movement table keeps them by counts, so a forward with counts seen before reuses them.
    """

    def __init__(self, mode: RowMode, counts: tuple[int, ...], parallel: Parallel,
                 table: "MovementTable | None" = None) -> None:
        dims = parallel.dims
        if len(counts) != dims.attn_dp:
            raise ValueError(f"the batch has {len(counts)} DP token counts but attn_dp is "
                             f"{dims.attn_dp}")
        self.mode, self.counts, self.parallel = mode, tuple(counts), parallel
        self.table = table if table is not None else movement_table(parallel, mode)
        self.layouts = self.table.layouts
        a, d = dims.attn_tp, parallel.attn_dp_rank
        self.attn_tp, self.attn_dp, self.dp_rank, self.tp_rank = a, dims.attn_dp, d, \
            parallel.attn_tp_rank
        self.total, self.local = sum(counts), counts[d]
        self.offset = sum(counts[:d])
        # rs: every DP rank's rows cut in chunks of one size, so fixed-size collectives line up
        self.chunk = -(-max(counts) // a) if counts else 0
        if mode is RowMode.RS:
            per_dp = [chunk_rows(c, self.chunk, a) for c in counts]
        else:
            per_dp = [split_rows(c, a) for c in counts]
        self.scatter_sizes = tuple(n for sizes in per_dp for n in sizes)  # flat over TP ranks
        self.segment_sizes = per_dp[d]  # this DP rank's rows per attention-TP rank
        self.scattered = self.segment_sizes[self.tp_rank]
        self.scatter_offset = sum(self.segment_sizes[: self.tp_rank])
        self.padded_local = self.chunk * a  # what fixed-size collectives move
        self.padded_total = self.padded_local * self.attn_dp
        seg = self.padded_local
        # padded position of each global row (every DP segment padded to attn_tp chunks)
        self.pad_index = torch.cat([torch.arange(c) + i * seg for i, c in enumerate(counts)]) \
            if counts else torch.zeros(0, dtype=torch.long)

    def move(self, owed: SumGroup | None, src: Layout, dst: Layout) -> "Movement":
        """The prebuilt movement for (owed, src, dst) in this forward's mode."""
        return self.table.lookup(owed, src, dst)

    def count(self, layout: Layout) -> int:
        """Rows this rank holds on ``layout``."""
        if layout == self.layouts.replicated:
            return self.total
        if layout == self.layouts.local:
            return self.local
        return self.scattered

    def global_indices(self, layout: Layout) -> torch.Tensor:
        """Global row index of each row this rank holds on ``layout``."""
        if layout == self.layouts.replicated:
            return torch.arange(self.total)
        start = self.offset + (0 if layout == self.layouts.local else self.scatter_offset)
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
            return coll.gather_rows(facts.pad(x, facts.chunk), group)[: facts.local]
        return coll.gather_rows_v(x, group, facts.segment_sizes)

    def expected(self, facts, width):
        fixed = facts.mode is RowMode.RS
        return _one("all_gather", facts.parallel.attn_tp,
                    facts.padded_local if fixed else facts.local, width)


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
        return _one("all_reduce", facts.parallel.attn_tp, facts.local, width)


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
                    facts.padded_local if fixed else facts.local, width)


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


IDENTITY, SLICE_DP, SLICE_SCATTER = Identity(), SliceDp(), SliceScatter()
SLICE_DP_SCATTER = SliceDpScatter()
GATHER_SCATTER, GATHER_DP, GATHER_DP_SCATTER = GatherScatter(), GatherDp(), GatherDpScatter()
ALL_REDUCE_ATTN_TP, REDUCE_SCATTER_ATTN_TP = AllReduceAttnTp(), ReduceScatterAttnTp()
ALL_REDUCE_TP_DP_PLACED, ALL_REDUCE_TP = AllReduceTpDpPlaced(), AllReduceTp()
ALL_REDUCE_TP_SLICE_DP, REDUCE_SCATTER_TP = AllReduceTpSliceDp(), ReduceScatterTp()


@dataclass(frozen=True, eq=False)
class Movement:
    """One resolved row of the table: how a value reaches ``dst`` from ``src`` in one mode."""

    name: str  # as plans print it, e.g. "reduce_scatter_v(tp)"
    owed: SumGroup | None
    src: Layout
    dst: Layout
    primitive: Primitive
    contract: str  # its row contract, one line
    run: object = field(init=False, repr=False)  # the primitive's run, bound once
    moves: bool = field(init=False, repr=False)  # False for the identity: callers skip it

    def __post_init__(self) -> None:
        object.__setattr__(self, "run", self.primitive.run)
        object.__setattr__(self, "moves", self.primitive is not IDENTITY)

    @property
    def allocates(self) -> bool:
        return self.primitive.allocates

    def __call__(self, facts: RowFacts, x: torch.Tensor) -> torch.Tensor:
        return self.run(facts, x)

    def expected(self, facts: RowFacts, width: int) -> list[tuple[str, str, int]]:
        return self.primitive.expected(facts, width)


DP, TS = TokenAxis.ATTN_DP, TokenAxis.ATTN_TP_SCATTER
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
    # an attention partial: summed over attention TP on its DP rank's rows
    _t(SumGroup.ATTN_TP, (), (), ALL_MODES, ALL_REDUCE_ATTN_TP,
       "rows unchanged, summed over attention TP", source="local"),
    _t(SumGroup.ATTN_TP, (), (TS,), SCATTERING, REDUCE_SCATTER_ATTN_TP,
       "each attention-TP rank gets the sum of its slice", source="local"),
    _t(SumGroup.ATTN_TP, (DP,), (), {RowMode.AR}, ALL_REDUCE_TP_DP_PLACED,
       "each DP rank's partial placed in a zero global buffer and summed over TP: the sum "
       "and the DP gather in one collective", source="local"),
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


def _name(primitive: Primitive, mode: RowMode) -> str:
    return primitive.name.replace("{v}", "_v" if mode is RowMode.RSV else "")


def _no_movement(owed, src: Layout, dst: Layout, mode: RowMode) -> str:
    what = f"a sum over {owed.value}" if owed is not None else "a complete value"
    return f"no row movement takes {what} on {src} rows to {dst} rows in {mode.value} mode"


def resolve(owed, src: Layout, dst: Layout, mode: RowMode, layouts: Layouts) -> Movement | None:
    """The table's movement for this pair, or None when it holds none."""
    for row in TRANSITIONS:
        if row.matches(owed, src, dst, mode, layouts):
            return Movement(_name(row.primitive, mode), owed, src, dst, row.primitive,
                            row.contract)
    return None


class MovementTable:
    """Every supported (owed, src, dst) of one topology and row mode, resolved once, and the
    row facts of the forwards that use it (kept by DP token counts)."""

    FACTS_KEPT = 256  # distinct DP token counts remembered (a serving loop's batch shapes)

    def __init__(self, parallel: Parallel, mode: RowMode) -> None:
        self.parallel, self.mode = parallel, mode
        self.layouts = layouts = Layouts.of(parallel)
        # an ordered list, not a set: every rank must see the table in one order
        named = [layouts.replicated, layouts.local]
        if mode is not RowMode.AR:
            named.append(layouts.scattered)
        names = list(dict.fromkeys(named))
        self._moves: dict[tuple, Movement] = {}
        for owed in (None, *SumGroup):
            for src in names:
                for dst in names:
                    movement = resolve(owed, src, dst, mode, layouts)
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

    def facts(self, counts: tuple[int, ...]) -> RowFacts:
        """The row facts of a forward with these DP token counts (built once per counts)."""
        facts = self._facts.get(counts)
        if facts is None:
            if len(self._facts) >= self.FACTS_KEPT:
                self._facts.pop(next(iter(self._facts)))
            facts = self._facts[counts] = RowFacts(self.mode, counts, self.parallel, self)
        return facts

    def rows(self) -> list[dict]:
        """The table as printable rows (for ``plan`` and tests)."""
        return [{"owed": None if m.owed is None else m.owed.value, "from": str(m.src),
                 "to": str(m.dst), "movement": m.name, "contract": m.contract}
                for m in self._moves.values()]


@functools.lru_cache(maxsize=None)
def movement_table(parallel: Parallel, mode: RowMode) -> MovementTable:
    """The table of one topology and mode (resolved once per topology: a pure memo)."""
    return MovementTable(parallel, mode)


def table_rows(parallel: Parallel, mode: RowMode) -> list[dict]:
    """The resolved table as printable rows (for ``plan`` and tests)."""
    return movement_table(parallel, mode).rows()
