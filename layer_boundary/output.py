"""Internal reduction handoffs, producer-specific finalize handoffs, and the table of row
completions: how a value owing a sum (or none) reaches the rows a consumer updates on."""

from __future__ import annotations

from typing import Callable

import torch

from .contracts import Owed
from .layout import BatchRows, Rows, SumGroup


class HandoffOutput:
    """Producer-specific work (such as a deferred MoE finalize) left for the next input.

    ``complete()`` is the unfused completion path; a fusion provider may do better.
    """

    def complete(self) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


def _same(rows: BatchRows, x: torch.Tensor) -> torch.Tensor:
    return x


def _global_to_scattered(rows: BatchRows, x: torch.Tensor) -> torch.Tensor:
    return rows.local_to_scattered(rows.global_to_local(x))


# (owed sum group or None, rows the value is on, rows it must reach) -> movement
_COMPLETIONS: dict[tuple, Callable] = {
    (None, Rows.LOCAL, Rows.LOCAL): _same,
    (None, Rows.LOCAL, Rows.SCATTERED): BatchRows.local_to_scattered,
    (None, Rows.SCATTERED, Rows.SCATTERED): _same,
    (None, Rows.SCATTERED, Rows.LOCAL): BatchRows.scattered_to_local,
    (None, Rows.GLOBAL, Rows.LOCAL): BatchRows.global_to_local,
    (None, Rows.GLOBAL, Rows.SCATTERED): _global_to_scattered,
    (SumGroup.ATTN_TP, Rows.LOCAL, Rows.LOCAL): BatchRows.sum_local_partial,
    (SumGroup.ATTN_TP, Rows.LOCAL, Rows.SCATTERED): BatchRows.sum_local_partial_to_scattered,
    (SumGroup.TP, Rows.GLOBAL, Rows.LOCAL): BatchRows.sum_global_partial_to_local,
    (SumGroup.TP, Rows.GLOBAL, Rows.SCATTERED): BatchRows.sum_global_partial_to_scattered,
    # every rank of the TP group holds experts (moe_ep x moe_tp), so the MoE output sums there
    (SumGroup.MOE_OUT, Rows.GLOBAL, Rows.LOCAL): BatchRows.sum_global_partial_to_local,
    (SumGroup.MOE_OUT, Rows.GLOBAL, Rows.SCATTERED): BatchRows.sum_global_partial_to_scattered,
}

# (rows a read produced, rows compute consumes) -> movement
_INPUT_MOVES: dict[tuple, Callable] = {
    (Rows.LOCAL, Rows.LOCAL): _same,
    (Rows.LOCAL, Rows.GLOBAL): BatchRows.local_to_global,
    (Rows.SCATTERED, Rows.LOCAL): BatchRows.scattered_to_local,
    (Rows.SCATTERED, Rows.GLOBAL): BatchRows.scattered_to_global,
}

_NAMES = {
    _same: "-", BatchRows.local_to_scattered: "slice", BatchRows.scattered_to_local:
    "all_gather(attn_tp)", BatchRows.global_to_local: "slice", _global_to_scattered: "slice",
    BatchRows.sum_local_partial: "all_reduce(attn_tp)",
    BatchRows.sum_global_partial_to_local: "all_reduce(tp)+slice",
    BatchRows.local_to_global: "all_gather_v(attn_dp)",
    BatchRows.scattered_to_global: "all_gather(tp)",
}


def completion(owed_group: SumGroup | None, src: Rows, dst: Rows) -> Callable:
    """The movement that finishes a value's owed sum onto ``dst`` rows (chosen at construction)."""
    try:
        return _COMPLETIONS[(owed_group, src, dst)]
    except KeyError:
        what = f"a sum over {owed_group.value}" if owed_group else "a complete value"
        raise ValueError(f"no row movement takes {what} on {src.value} rows to {dst.value} "
                         "rows") from None


def input_move(src: Rows, dst: Rows) -> Callable:
    return _INPUT_MOVES[(src, dst)]


def describe_move(fn: Callable, mode, attn_dp: int = 1) -> str:
    """A short name of a movement for plan tables (slices and gathers over one DP rank drop)."""
    if attn_dp == 1 and fn in (BatchRows.local_to_global, BatchRows.global_to_local):
        return "-"
    if attn_dp == 1 and fn is BatchRows.sum_global_partial_to_local:
        return "all_reduce(tp)"
    if fn in (BatchRows.sum_local_partial_to_scattered, BatchRows.sum_global_partial_to_scattered):
        group = "attn_tp" if fn is BatchRows.sum_local_partial_to_scattered else "tp"
        return f"{'reduce_scatter' if mode.value == 'rs' else 'reduce_scatter_v'}({group})"
    if fn in (BatchRows.scattered_to_local, BatchRows.scattered_to_global):
        group = "attn_tp" if fn is BatchRows.scattered_to_local else "tp"
        return f"{'all_gather' if mode.value == 'rs' else 'all_gather_v'}({group})"
    return _NAMES.get(fn, getattr(fn, "__name__", "?"))


def complete_value(value, owed: Owed | None, rows_at: Rows, target: Rows, batch_rows: BatchRows):
    """Unfused completion any accessor may run: finalize a handoff, finish the owed sum, and
    bring the value onto ``target`` rows."""
    if isinstance(value, HandoffOutput):
        value = value.complete()
    key = (None if owed is None else owed.group, rows_at, target)
    return completion(*key)(batch_rows, value)
