"""Token-row movements: one table of supported transitions over the primitives that move rows
(``primitives.py``), resolved against a topology and row mode, and the row facts
(``row_facts.py``) a forward's movements run on.

A movement takes a value on a source layout, owing a sum or nothing, to a destination layout.
Each way of moving rows is one ``Primitive`` object (``primitives.py``).
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

from dataclasses import dataclass, field


from .contracts import UnsupportedBoundary
from .layout import Layout, Layouts, RowMode, SumGroup, TokenAxis
from .primitives import (ALL_REDUCE_ATTN_TP, ALL_REDUCE_ATTN_TP_GATHER_CP, ALL_REDUCE_TP,
                         ALL_REDUCE_TP_DP_PLACED, ALL_REDUCE_TP_SELECT_SHARE,
                         ALL_REDUCE_TP_SLICE_DP, GATHER_CP, GATHER_CP_SCATTER, GATHER_DP,
                         GATHER_DP_SCATTER, GATHER_PARTS, GATHER_PARTS_SCATTER, GATHER_SCATTER,
                         IDENTITY, REDUCE_SCATTER_ATTN_TP, REDUCE_SCATTER_PARTS,
                         REDUCE_SCATTER_TP, SELECT_SHARE, SELECT_SHARE_SCATTER, SLICE_CP,
                         SLICE_CP_SCATTER, SLICE_DP, SLICE_DP_SCATTER, SLICE_SCATTER, Primitive)
from .row_facts import (BatchRows, RowFacts, chunk_rows, cp_share_sizes,  # noqa: F401
                        cp_shares, split_rows)
from .runtime.parallel import Parallel


@dataclass(frozen=True, eq=False, slots=True)
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
    move: object = field(init=False, repr=False)  # the primitive's move(facts, x), bound once
    moves: bool = field(init=False, repr=False)  # False for the identity: callers skip it

    def __post_init__(self) -> None:
        object.__setattr__(self, "move", self.primitive.move)
        object.__setattr__(self, "moves", self.primitive is not IDENTITY and not self.alone)

    @property
    def allocates(self) -> bool:
        """Whether its result is new storage (never where nothing moves)."""
        return self.moves and self.primitive.allocates

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
                                       alone=parallel.tp_group.size == 1)
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


def movement_table(parallel: Parallel, mode: RowMode, cp: bool = False) -> MovementTable:
    """The table of one topology, mode and variant (resolved once per topology: a memo kept
    on the topology, released with it)."""
    key = ("movement_table", mode, cp)
    table = parallel.memo.get(key)
    if table is None:
        table = parallel.memo[key] = MovementTable(parallel, mode, cp)
    return table


def table_rows(parallel: Parallel, mode: RowMode, cp: bool = False) -> list[dict]:
    """The resolved table as printable rows (for ``plan`` and tests)."""
    return movement_table(parallel, mode, cp).rows()


def row_facts(mode: RowMode, counts: tuple[int, ...], parallel: Parallel,
              request_lens=None) -> RowFacts:
    """The row facts of a forward with these DP token counts (and, in a CP batch, every DP
    rank's request lengths) in row mode ``mode``, from its topology's movement table."""
    lens = None if request_lens is None else tuple(tuple(per) for per in request_lens)
    return movement_table(parallel, mode, cp=lens is not None).facts(tuple(counts), lens)
