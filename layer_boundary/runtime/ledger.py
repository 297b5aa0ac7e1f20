"""Observers of a forward, and the communication ledger that is one.

A forward reports to at most one observer through one hook (``HOOK.observer``): each
boundary phase it enters (``enter``), every collective, and the residual stream after each boundary
call. With no observer installed a forward mutates no global state for it. Nothing is
observed while ``torch.compile`` traces: a compiled forward runs no Python to report from.

The ledger records what each collective logically moves (kind, group, element count, dtype)
and the ring-formula bytes for that kind, so tests can compare a forward against a path's
analytic collective list and the command line can report volume per layer. An all-to-all
(a MoE's dispatch and combine) records the elements this rank sends to the other ranks: they
follow the routing, so its bytes vary per forward and per rank (its own block never moves).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from .modes import MODES, scoped


class Observer(Protocol):
    """What watches a forward's collectives (the ledger, traces): ``enter(site)`` as a
    boundary call starts, ``collective(kind, group, numel, dtype, site)`` for each one.

    ``records_wire``: it takes what the backend moves too (``collective(..., wire_numel=,
    wire_kind=)``); declared on the observer's own class (``declares_wire``), never inherited
    by a subclass whose ``collective`` may take five arguments only."""

    records_wire: bool

    def enter(self, site: str) -> None: ...

    def collective(self, kind: str, group, numel: int, dtype, site: str | None) -> None: ...

    def boundary(self, site: str, stream, facts) -> None: ...


class _Hook:
    """The one observation point: ``HOOK.observer`` (None: nobody watches, and a forward
    does no work for observation), installed with ``observing(observer)``."""

    __slots__ = ()

    @property
    def observer(self) -> Observer | None:
        return MODES.observer  # the run-wide mode (``modes.MODES.observer``)


HOOK = _Hook()


def declares_wire(observer) -> bool:
    """Whether ``observer``'s own class declares ``records_wire``."""
    return type(observer).__dict__.get("records_wire", False) is True


def active_observer() -> Observer | None:
    """The installed observer, or None (also while torch.compile traces)."""
    observer = HOOK.observer
    if observer is None or torch.compiler.is_compiling():
        return None
    return observer


@contextlib.contextmanager
def observing(observer: Observer):
    """Install ``observer`` for the enclosed block (the previous one comes back after)."""
    with scoped(observer=observer):
        yield observer


@dataclass(frozen=True)
class LedgerEntry:
    kind: str  # "all_reduce", "all_gather", "reduce_scatter", ...
    group: str  # the runtime group's name ("tp", "attn_tp", "attn_dp")
    group_size: int
    numel: int  # logical elements of the full (unsplit) tensor the collective acts on
    dtype: torch.dtype
    site: str  # "<stage name>.<phase>" or a runtime label ("embed", "lm_head")
    step: int = 0  # which forward of a generation (0 = prefill)
    # elements the implementation moves where that is not ``numel``: a variable-size gather,
    # which gloo (no uneven all-gather) runs padded to the widest rank; None: ``numel``
    wire_numel: int | None = None
    # the collective the implementation ran where that is not ``kind``: a small sum on gloo
    # runs as an all-gather of every rank's tensor (``collectives.sums_by_gather``)
    wire_kind: str | None = None

    @property
    def bytes(self) -> int:
        """Per-rank bytes sent by a ring implementation of this collective (the logical
        figure: what the collective must move, whatever the backend does)."""
        return _ring_bytes(self.kind, self.numel * self.dtype.itemsize, self.group_size)

    def wire_bytes(self, backend: str = "gloo") -> int:
        """Per-rank bytes ``backend`` really sends for it. On gloo gloo's own reduce-scatter
        (issued asynchronously, or compiled) is an all-reduce of the whole tensor (each rank
        then keeps its block), and a synchronous one an all-to-all of the blocks
        (``wire_kind``: the ring figure); a variable gather moves every rank's block padded
        to the widest, and a small sum is a gather of every rank's tensor; NCCL (any other
        backend here) moves the logical figure."""
        if backend != "gloo":
            return self.bytes
        size = (self.numel if self.wire_numel is None else self.wire_numel) * self.dtype.itemsize
        kind = self.wire_kind or ("all_reduce" if self.kind == "reduce_scatter" else self.kind)
        return _ring_bytes(kind, size, self.group_size)


def _ring_bytes(kind: str, size: int, n: int) -> int:
    if kind in ("send", "recv"):  # point to point: the payload, once
        return size if kind == "send" else 0
    if kind == "broadcast":  # from one root: a tree sends it once per receiver
        return size
    if kind == "all_to_all":  # the size is what this rank sends to the others
        return size
    if kind == "all_reduce":
        return 2 * (n - 1) * size // n
    return (n - 1) * size // n


@dataclass(frozen=True)
class StreamTrace:
    """The residual stream right after one boundary call (for tests and debugging)."""

    site: str
    step: int
    state: str  # "initial" | "written" | "pending"
    residual_rows: str  # the residual's layout ("attn_dp", "attn_dp+attn_tp_scatter", ...)
    row_ids: torch.Tensor | None  # global token row of each residual row
    residual: torch.Tensor | None
    owed: str | None  # what the pending contribution still owes


class Ledger:
    """Records collectives (``recording``) and stream states (``tracing``) as an observer."""

    def __init__(self) -> None:
        self.enabled = False
        self.entries: list[LedgerEntry] = []
        self.site = "model"
        self.step = 0
        self.traces: list[StreamTrace] | None = None

    # -- the observer protocol

    def enter(self, site: str) -> None:
        self.site = site

    # an observer that takes what the backend moves too (``collective(..., wire_numel=,
    # wire_kind=)``); one that does not declare it gets the protocol's five arguments
    records_wire = True

    def collective(self, kind: str, group, numel: int, dtype, site: str | None = None,
                   wire_numel: int | None = None, wire_kind: str | None = None) -> None:
        if self.enabled:
            self.entries.append(LedgerEntry(kind, group.name, group.size, numel, dtype,
                                            site or self.site, self.step, wire_numel,
                                            wire_kind))

    def boundary(self, site: str, stream, facts) -> None:
        if self.traces is None:
            return
        residual = stream.residual
        c = stream.contribution
        layout = stream.residual_rows
        self.traces.append(StreamTrace(
            site, self.step, stream.state.value, "" if layout is None else str(layout),
            None if residual is None else facts.global_indices(layout),
            None if residual is None else residual.detach().clone(),
            None if c is None or c.owed is None else f"sum over {c.owed.value}"))

    # -- recording

    def record(self, kind: str, group, numel: int, dtype: torch.dtype) -> None:
        self.collective(kind, group, numel, dtype)

    @contextlib.contextmanager
    def recording(self):
        """Record the collectives of the enclosed block; yields the list being filled.

        A nested recording shadows the outer one for its block. Site and step start fresh
        and are restored afterwards.
        """
        previous = (self.enabled, self.entries, self.site, self.step)
        self.enabled, self.entries, self.site, self.step = True, [], "model", 0
        try:
            with observing(self):
                yield self.entries
        finally:
            self.enabled, self.entries, self.site, self.step = previous

    @contextlib.contextmanager
    def paused(self):
        """Record nothing in the enclosed block (a captured graph's warm-up forwards: the
        collectives the run performs are the replays', ``repeat``)."""
        previous = self.enabled
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = previous

    def repeat(self, entries) -> None:
        """Record ``entries`` again at the current step: what a replayed CUDA graph performs
        is what its capture recorded, and a replay runs no Python to report it."""
        if self.enabled:
            self.entries.extend(dataclasses.replace(e, step=self.step) for e in entries)

    @contextlib.contextmanager
    def tracing(self):
        """Record the residual stream after every boundary call of the enclosed block."""
        previous = self.traces
        self.traces = []
        try:
            with observing(self):
                yield self.traces
        finally:
            self.traces = previous


LEDGER = Ledger()


@contextlib.contextmanager
def ledger_site(site: str):
    """Attribute the collectives of the enclosed block to ``site``."""
    previous = LEDGER.site
    LEDGER.site = site
    try:
        yield
    finally:
        LEDGER.site = previous


def statistics_site() -> str:
    """Where a norm's sum of statistics over ranks is recorded: the current site with
    ``.statistics`` after it (a stage's compute holds it, but it completes no output: the
    exactly-once audit leaves it out)."""
    return f"{LEDGER.site}.statistics"


def wire_total(entries, backend: str = "gloo") -> int:
    """The bytes ``backend`` sends for ``entries`` (``LedgerEntry.wire_bytes``)."""
    return sum(e.wire_bytes(backend) for e in entries)


def summarize(entries) -> dict[str, dict[str, int]]:
    """{kind: {"count", "bytes"}} over ``entries``."""
    out: dict[str, dict[str, int]] = {}
    for e in entries:
        slot = out.setdefault(e.kind, {"count": 0, "bytes": 0})
        slot["count"] += 1
        slot["bytes"] += e.bytes
    return out
