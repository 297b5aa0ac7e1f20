"""Communication ledger: every collective a forward runs, with the site that ran it.

Each entry records what the path logically moves (kind, group, element count, dtype) and the
ring-formula bytes for that kind, so tests can compare a forward against a path's analytic
collective list and the command line can report volume per layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


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
        if self.kind == "all_reduce":
            return 2 * (n - 1) * size // n
        return (n - 1) * size // n


@dataclass(frozen=True)
class StreamTrace:
    """The residual stream right after one boundary call (for tests and debugging)."""

    site: str
    step: int
    state: str  # "initial" | "written" | "pending"
    residual_rows: str  # "local" | "scattered"
    row_ids: torch.Tensor | None  # global token row of each residual row (-1: padding)
    residual: torch.Tensor | None
    owed: str | None  # what the pending contribution still owes


class Ledger:
    """Process-wide recorder; off unless a caller turns it on."""

    def __init__(self) -> None:
        self.enabled = False
        self.entries: list[LedgerEntry] = []
        self.site = "model"
        self.step = 0
        self.traces: list[StreamTrace] | None = None  # stream states, when tracing

    @contextlib.contextmanager
    def tracing(self):
        """Record the residual stream after every boundary call of the enclosed block."""
        previous = self.traces
        self.traces = []
        try:
            yield self.traces
        finally:
            self.traces = previous

    def trace(self, site: str, stream, batch_rows) -> None:
        residual = stream.residual
        c = stream.contribution
        self.traces.append(StreamTrace(
            site, self.step, stream.state.value, stream.residual_rows.value,
            None if residual is None else batch_rows.global_indices(stream.residual_rows),
            None if residual is None else residual.detach().clone(),
            None if c is None or c.owed is None else str(c.owed)))

    def record(self, kind: str, group, numel: int, dtype: torch.dtype) -> None:
        if self.enabled:
            self.entries.append(LedgerEntry(kind, group.name, group.size, numel, dtype,
                                           self.site, self.step))

    @contextlib.contextmanager
    def recording(self):
        """Record the collectives of the enclosed block; yields the list being filled.

        A nested recording shadows the outer one for its block. Site and step start fresh
        and are restored afterwards.
        """
        previous = (self.enabled, self.entries, self.site, self.step)
        self.enabled, self.entries, self.site, self.step = True, [], "model", 0
        try:
            yield self.entries
        finally:
            self.enabled, self.entries, self.site, self.step = previous


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
