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
from dataclasses import dataclass
from typing import Protocol

import torch


class Observer(Protocol):
    def enter(self, site: str) -> None: ...

    def collective(self, kind: str, group, numel: int, dtype, site: str | None) -> None: ...

    def boundary(self, site: str, stream, rows) -> None: ...


class _Hook:
    """The one observation point: ``HOOK.observer`` (None: nobody watches, and a forward
    does no work for observation), installed with ``observing(observer)``."""

    __slots__ = ("observer",)

    def __init__(self) -> None:
        self.observer: Observer | None = None


HOOK = _Hook()


def active_observer() -> Observer | None:
    """The installed observer, or None (also while torch.compile traces)."""
    observer = HOOK.observer
    if observer is None or torch.compiler.is_compiling():
        return None
    return observer


@contextlib.contextmanager
def observing(observer: Observer):
    """Install ``observer`` for the enclosed block (the previous one comes back after)."""
    previous = HOOK.observer
    HOOK.observer = observer
    try:
        yield observer
    finally:
        HOOK.observer = previous


@dataclass(frozen=True)
class LedgerEntry:
    kind: str  # "all_reduce", "all_gather", "reduce_scatter", ...
    group: str  # the runtime group's name ("tp", "attn_tp", "attn_dp")
    group_size: int
    numel: int  # logical elements of the full (unsplit) tensor the collective acts on
    dtype: torch.dtype
    site: str  # "<stage name>.<phase>" or a runtime label ("embed", "lm_head")
    step: int = 0  # which forward of a generation (0 = prefill)

    @property
    def bytes(self) -> int:
        """Per-rank bytes sent by a ring implementation of this collective."""
        size = self.numel * self.dtype.itemsize
        n = self.group_size
        if self.kind in ("send", "recv"):  # point to point: the payload, once
            return size if self.kind == "send" else 0
        if self.kind == "broadcast":  # from one root: a tree sends it once per receiver
            return size
        if self.kind == "all_to_all":  # numel is what this rank sends to the others
            return size
        if self.kind == "all_reduce":
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

    def collective(self, kind: str, group, numel: int, dtype, site: str | None = None) -> None:
        if self.enabled:
            self.entries.append(LedgerEntry(kind, group.name, group.size, numel, dtype,
                                            site or self.site, self.step))

    def boundary(self, site: str, stream, rows) -> None:
        if self.traces is None:
            return
        residual = stream.residual
        c = stream.contribution
        layout = stream.residual_rows
        self.traces.append(StreamTrace(
            site, self.step, stream.state.value, "" if layout is None else str(layout),
            None if residual is None else rows.global_indices(layout),
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


def summarize(entries) -> dict[str, dict[str, int]]:
    """{kind: {"count", "bytes"}} over ``entries``."""
    out: dict[str, dict[str, int]] = {}
    for e in entries:
        slot = out.setdefault(e.kind, {"count": 0, "bytes": 0})
        slot["count"] += 1
        slot["bytes"] += e.bytes
    return out
