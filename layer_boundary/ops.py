"""Token-row movements: one table of supported transitions, and the row facts they run on.

A movement takes a value on a source layout, owing a sum or nothing, to a destination layout.
``TRANSITIONS`` is the only place a movement is chosen: each row names the sum it completes,
the token axes it gathers and scatters, the row modes it serves, and the primitive that runs
it with its collective, group, padding and row-order contract. ``movement_table`` resolves the
rows against one topology and row mode at construction; a pair it does not hold has no
implementation and is rejected there. Nothing here runs per forward except the primitives.

Row order: the global batch is the attention-DP ranks' tokens in DP rank order; a DP rank's
rows are cut over attention TP in TP rank order, in ``rs`` as equal chunks of
ceil(max rows / attn_tp) (the last ranks may hold fewer, or none) and in ``rsv`` as balanced
slices (the first ranks take the remainder). Tensors hold real rows only; a fixed-size
collective pads inside itself and the ledger records the padded size it moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .layout import Layout, Layouts, RowMode, SumGroup, TokenAxis
from .runtime import collectives as coll
from .runtime.parallel import Parallel


class UnsupportedBoundary(ValueError):
    """A transition this package has no correct implementation for."""


def split_rows(n: int, parts: int) -> tuple[int, ...]:
    """Real rows per part when ``n`` rows are split in order over ``parts`` ranks (balanced)."""
    return tuple(n // parts + (1 if i < n % parts else 0) for i in range(parts))


def chunk_rows(n: int, chunk: int, parts: int) -> tuple[int, ...]:
    """Real rows per part when ``n`` rows are cut in order into chunks of ``chunk`` rows."""
    return tuple(max(0, min(chunk, n - i * chunk)) for i in range(parts))


class BatchRows:
    """One forward's row facts on this rank, and the primitives that move rows.

    Built once per forward from the batch's DP token counts (every rank agrees on them), so
    every rank sizes its collectives identically, including ranks with no tokens.
    """

    def __init__(self, mode: RowMode, counts: tuple[int, ...], parallel: Parallel,
                 table: dict | None = None) -> None:
        dims = parallel.dims
        if len(counts) != dims.attn_dp:
            raise ValueError(f"the batch has {len(counts)} DP token counts but attn_dp is "
                             f"{dims.attn_dp}")
        self.mode, self.counts, self.parallel = mode, tuple(counts), parallel
        self.table = table if table is not None else movement_table(parallel, mode)
        self.layouts = self.table["layouts"]
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
        self._pad_index = None
        self.path_key = ("ordinary", mode.value)  # (batch variant, mode): what plans select on
        self.runtime = None  # the BoundaryRuntime of the stages that placed these rows

    def move(self, owed: SumGroup | None, src: Layout, dst: Layout) -> "Movement":
        """The prebuilt movement for (owed, src, dst) in this forward's mode."""
        return lookup(self.table, owed, src, dst, self.mode)

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

    # -- padding, inside fixed-size collectives only

    @staticmethod
    def _pad(x: torch.Tensor, rows: int) -> torch.Tensor:
        if x.shape[0] == rows:
            return x
        padded = x.new_zeros((rows, *x.shape[1:]))
        padded[: x.shape[0]] = x
        return padded

    def _global_pad_index(self, device) -> torch.Tensor:
        """Padded position of each global row (every DP segment padded to attn_tp chunks)."""
        if self._pad_index is None:
            seg = self.chunk * self.attn_tp
            self._pad_index = torch.cat([torch.arange(c, device=device) + i * seg
                                         for i, c in enumerate(self.counts)])
        return self._pad_index

    def _pad_global(self, x: torch.Tensor) -> torch.Tensor:
        padded = x.new_zeros((self.chunk * self.attn_tp * self.attn_dp, *x.shape[1:]))
        return padded.index_copy_(0, self._global_pad_index(x.device), x)

    # -- primitives: each is a movement of the table (contracts in TRANSITIONS)

    def identity(self, x):
        return x

    def slice_dp(self, x):
        if self.attn_dp == 1:
            return x
        return x[self.offset:self.offset + self.local]

    def slice_scatter(self, x):
        if self.attn_tp == 1:
            return x
        return x[self.scatter_offset:self.scatter_offset + self.scattered]

    def slice_dp_scatter(self, x):
        return self.slice_scatter(self.slice_dp(x))

    def gather_scatter(self, x):
        group = self.parallel.attn_tp
        if self.mode is RowMode.RS:
            return coll.gather_rows(self._pad(x, self.chunk), group)[: self.local]
        return coll.gather_rows_v(x, group, self.segment_sizes)

    def gather_dp(self, x):
        return coll.gather_rows_v(x, self.parallel.attn_dp, self.counts)

    def gather_dp_scatter(self, x):
        group = self.parallel.tp
        if self.mode is RowMode.RS:
            if group.size == 1:
                return x
            gathered = coll.gather_rows(self._pad(x, self.chunk), group)
            return gathered.index_select(0, self._global_pad_index(x.device))
        return coll.gather_rows_v(x, group, self.scatter_sizes)

    def all_reduce_attn_tp(self, x):
        return coll.all_reduce_rows(x, self.parallel.attn_tp)

    def reduce_scatter_attn_tp(self, x):
        group = self.parallel.attn_tp
        if self.mode is RowMode.RS:
            out = coll.reduce_scatter_rows(self._pad(x, self.chunk * self.attn_tp), group)
            return out[: self.scattered]
        return coll.reduce_scatter_rows_v(x, group, self.segment_sizes)

    def all_reduce_tp_dp_placed(self, x):
        if self.parallel.tp.size == 1:
            return x
        buffer = x.new_zeros((self.total, *x.shape[1:]))
        buffer[self.offset:self.offset + self.local] = x
        return coll.all_reduce_rows(buffer, self.parallel.tp)

    def all_reduce_tp(self, x):
        return coll.all_reduce_rows(x, self.parallel.tp)

    def all_reduce_tp_slice_dp(self, x):
        return self.slice_dp(coll.all_reduce_rows(x, self.parallel.tp))

    def reduce_scatter_tp(self, x):
        group = self.parallel.tp
        if self.mode is RowMode.RS:
            if group.size == 1:
                return x
            return coll.reduce_scatter_rows(self._pad_global(x), group)[: self.scattered]
        return coll.reduce_scatter_rows_v(x, group, self.scatter_sizes)

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

    # -- what each primitive's collectives move, for comparing a plan with the ledger

    def expected(self, primitive: str, width: int) -> list[tuple[str, str, int]]:
        """[(kind, group, logical elements)] that ``primitive`` runs on ``width``-wide rows."""
        par, a, fixed = self.parallel, self.attn_tp, self.mode is RowMode.RS
        padded_local, padded_total = self.chunk * a, self.chunk * a * self.attn_dp

        def one(kind, group, rows):
            return [(kind, group.name, rows * width)] if group.size > 1 and rows else []

        return {
            "gather_scatter": lambda: one("all_gather", par.attn_tp,
                                          padded_local if fixed else self.local),
            "gather_dp": lambda: one("all_gather", par.attn_dp, self.total),
            "gather_dp_scatter": lambda: one("all_gather", par.tp,
                                             padded_total if fixed else self.total),
            "all_reduce_attn_tp": lambda: one("all_reduce", par.attn_tp, self.local),
            "reduce_scatter_attn_tp": lambda: one("reduce_scatter", par.attn_tp,
                                                  padded_local if fixed else self.local),
            "all_reduce_tp_dp_placed": lambda: one("all_reduce", par.tp, self.total),
            "all_reduce_tp": lambda: one("all_reduce", par.tp, self.total),
            "all_reduce_tp_slice_dp": lambda: one("all_reduce", par.tp, self.total),
            "reduce_scatter_tp": lambda: one("reduce_scatter", par.tp,
                                             padded_total if fixed else self.total),
        }.get(primitive, list)()


@dataclass(frozen=True, eq=False)
class Movement:
    """One resolved row of the table: how a value reaches ``dst`` from ``src``."""

    name: str  # as plans print it, e.g. "reduce_scatter_v(tp)"
    owed: SumGroup | None
    src: Layout
    dst: Layout
    primitive: str  # the BatchRows method that runs it
    contract: str  # its row contract, one line
    allocates: bool  # returns storage nothing else holds (a gather), never an alias
    run: Callable = field(init=False, repr=False)  # BatchRows.<primitive>, bound once
    moves: bool = field(init=False, repr=False)  # False for the identity: callers skip it

    def __post_init__(self) -> None:
        object.__setattr__(self, "run", getattr(BatchRows, self.primitive))
        object.__setattr__(self, "moves", self.primitive != "identity")

    def __call__(self, rows: BatchRows, x: torch.Tensor) -> torch.Tensor:
        return self.run(rows, x)

    def expected(self, rows: BatchRows, width: int) -> list[tuple[str, str, int]]:
        return rows.expected(self.primitive, width)


DP, TS = TokenAxis.ATTN_DP, TokenAxis.ATTN_TP_SCATTER
ALL_MODES = frozenset(RowMode)
SCATTERING = frozenset({RowMode.RS, RowMode.RSV})
TP_SUMS = frozenset({SumGroup.TP, SumGroup.MOE_OUT})


@dataclass(frozen=True)
class Transition:
    """A row of the table: a value owing one of ``owed`` (None: nothing), on a layout that
    loses ``gathers`` and gains ``scatters``, in one of ``modes``."""

    owed: frozenset
    gathers: frozenset
    scatters: frozenset
    modes: frozenset
    primitive: str
    name: str  # "{v}" becomes "_v" in rsv (variable-size collectives)
    contract: str
    # the named layout (Layouts field) the value must be on: a partial sums over the ranks
    # that hold the same rows, so its rows are fixed by the group it owes
    source: str | None = None
    needs_scattered_target: bool = False  # only onto the scattered residual layout
    allocates: bool = False

    def matches(self, owed, src: Layout, dst: Layout, mode: RowMode, layouts: Layouts) -> bool:
        return (owed in self.owed and mode in self.modes
                and src.sharded - dst.sharded == self.gathers
                and dst.sharded - src.sharded == self.scatters
                and (self.source is None or src == getattr(layouts, self.source))
                and (not self.needs_scattered_target or dst == layouts.scattered))


def _t(owed, gathers, scatters, modes, primitive, name, contract, **kw) -> Transition:
    owed = frozenset(owed) if isinstance(owed, (set, frozenset)) else frozenset({owed})
    return Transition(owed, frozenset(gathers), frozenset(scatters), frozenset(modes),
                      primitive, name, contract, **kw)


TRANSITIONS: tuple[Transition, ...] = (
    # complete values: slices are free, gathers allocate
    _t(None, (), (), ALL_MODES, "identity", "-", "rows unchanged"),
    _t(None, (), (DP,), ALL_MODES, "slice_dp", "slice(dp)",
       "this DP rank's segment of the global rows"),
    _t(None, (), (TS,), SCATTERING, "slice_scatter", "slice(attn_tp)",
       "this attention-TP rank's slice of its DP rank's rows"),
    _t(None, (), (DP, TS), SCATTERING, "slice_dp_scatter", "slice(tp)",
       "this rank's slice of its DP rank's segment of the global rows"),
    _t(None, (TS,), (), SCATTERING, "gather_scatter", "all_gather{v}(attn_tp)",
       "the DP rank's rows from its attention-TP slices, in TP rank order", allocates=True),
    _t(None, (DP,), (), ALL_MODES, "gather_dp", "all_gather_v(attn_dp)",
       "every DP rank's rows, in DP rank order", allocates=True),
    _t(None, (DP, TS), (), SCATTERING, "gather_dp_scatter", "all_gather{v}(tp)",
       "every rank's slice, in TP rank order: the global rows", allocates=True),
    # an attention partial: summed over attention TP on its DP rank's rows
    _t(SumGroup.ATTN_TP, (), (), ALL_MODES, "all_reduce_attn_tp", "all_reduce(attn_tp)",
       "rows unchanged, summed over attention TP", source="local"),
    _t(SumGroup.ATTN_TP, (), (TS,), SCATTERING, "reduce_scatter_attn_tp",
       "reduce_scatter{v}(attn_tp)", "each attention-TP rank gets the sum of its slice",
       source="local"),
    _t(SumGroup.ATTN_TP, (DP,), (), {RowMode.AR}, "all_reduce_tp_dp_placed", "all_reduce(tp)",
       "each DP rank's partial placed in a zero global buffer and summed over TP: the sum "
       "and the DP gather in one collective", source="local", allocates=True),
    # a TP-group partial on the global rows
    _t(TP_SUMS, (), (), ALL_MODES, "all_reduce_tp", "all_reduce(tp)",
       "global rows unchanged, summed over TP", source="replicated"),
    _t(TP_SUMS, (), (DP,), SCATTERING, "reduce_scatter_tp", "reduce_scatter{v}(tp)",
       "each rank gets the sum of its DP rank's rows", source="replicated",
       needs_scattered_target=True),
    _t(TP_SUMS, (), (DP,), ALL_MODES, "all_reduce_tp_slice_dp", "all_reduce(tp)+slice(dp)",
       "summed over TP, then this DP rank's segment", source="replicated"),
    _t(TP_SUMS, (), (TS,), SCATTERING, "reduce_scatter_tp", "reduce_scatter{v}(tp)",
       "each rank gets the sum of its slice", source="replicated"),
    _t(TP_SUMS, (), (DP, TS), SCATTERING, "reduce_scatter_tp", "reduce_scatter{v}(tp)",
       "each rank gets the sum of its slice of its DP rank's rows", source="replicated"),
)


def _name(transition: Transition, mode: RowMode) -> str:
    return transition.name.replace("{v}", "_v" if mode is RowMode.RSV else "")


def _no_movement(owed, src: Layout, dst: Layout, mode: RowMode) -> str:
    what = f"a sum over {owed.value}" if owed is not None else "a complete value"
    return f"no row movement takes {what} on {src} rows to {dst} rows in {mode.value} mode"


def resolve(owed, src: Layout, dst: Layout, mode: RowMode, layouts: Layouts) -> Movement | None:
    """The table's movement for this pair, or None when it holds none."""
    for row in TRANSITIONS:
        if row.matches(owed, src, dst, mode, layouts):
            return Movement(_name(row, mode), owed, src, dst, row.primitive, row.contract,
                            row.allocates)
    return None


_TABLES: dict = {}


def movement_table(parallel: Parallel, mode: RowMode) -> dict:
    """Every supported (owed, src, dst) of one topology and mode, resolved once.

    Keys are (owed SumGroup or None, src layout key, dst layout key); the entry "layouts"
    holds the topology's named layouts.
    """
    table = _TABLES.get((parallel, mode))
    if table is None:
        layouts = Layouts.of(parallel)
        # an ordered list, not a set: every rank must see the table in one order
        named = [layouts.replicated, layouts.local]
        if mode is not RowMode.AR:
            named.append(layouts.scattered)
        names = list(dict.fromkeys(named))
        table = {"layouts": layouts}
        for owed in (None, *SumGroup):
            for src in names:
                for dst in names:
                    movement = resolve(owed, src, dst, mode, layouts)
                    if movement is not None:
                        table[(owed, src.key, dst.key)] = movement
        _TABLES[(parallel, mode)] = table
    return table


def lookup(table: dict, owed, src: Layout, dst: Layout, mode: RowMode) -> Movement:
    """A movement of the table, or the construction-time rejection naming the pair."""
    movement = table.get((owed, src.key, dst.key))
    if movement is None:
        raise UnsupportedBoundary(_no_movement(owed, src, dst, mode))
    return movement


def table_rows(parallel: Parallel, mode: RowMode) -> list[dict]:
    """The resolved table as printable rows (for ``plan`` and tests)."""
    table = movement_table(parallel, mode)
    return [{"owed": None if m.owed is None else m.owed.value, "from": str(m.src),
             "to": str(m.dst), "movement": m.name, "contract": m.contract}
            for key, m in table.items() if key != "layouts"]
