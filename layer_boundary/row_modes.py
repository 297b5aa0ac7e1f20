"""Which row mode a forward takes, and which modes and batch variants a stage builds paths for.

Decided from the runtime (its topology and ``boundary_reduction`` policy) and a forward's DP
token counts: the same on every rank, since every rank sees the same counts. Construction
builds a stage's paths for ``plan_variants`` x ``supported_modes``; placing a forward selects
one with ``select_mode``.
"""

from __future__ import annotations

import torch

from .contracts import BatchVariant, UnsupportedBoundary
from .layout import RowMode
from .runtime.invariant import BATCH_INVARIANT


# the batch variants that keep the residual scattered over attention TP in every stage
SCATTERED_VARIANTS = (BatchVariant.SEQUENCE_PARALLEL,)


def select_mode(runtime, counts: tuple[int, ...], parts: tuple[int, ...] | None = None,
                cp: bool = False, variant: BatchVariant = BatchVariant.ORDINARY
                ) -> tuple[RowMode, str]:
    """The row mode of a forward with these DP token counts (and, in a CP batch, these
    partitions: its (DP, CP) shares), and why (policy is permission). A sequence-parallel
    batch takes rsv or rs (its residual is scattered) and never falls back to ar."""
    dims = runtime.parallel.dims
    parts = counts if parts is None else parts
    if dims.tp == 1:
        return RowMode.AR, "tp=1"
    scattered = keeps_scattered(runtime, variant)
    # an ordinary batch only: a variant the engine asked for (input-scattered attention) keeps
    # the policy's scattered mode, where its path differs
    # batch-invariant: the policy's mode for every batch (chosen by a batch's bytes, a request
    # alone took ar and the batch rsv: other bits at tp 4 dp 2, with choose_by_bytes=True)
    if (runtime.choose_by_bytes and not BATCH_INVARIANT.on and variant is BatchVariant.ORDINARY
            and not scattered and not cp):
        why_ar = _ar_is_cheaper(runtime, counts)
        if why_ar is not None:
            return RowMode.AR, why_ar
    if runtime.allows_rsv:
        if (not cp and torch.compiler.is_compiling()
                and (min(parts) if parts else 0) < dims.attn_tp):  # (no default=: dynamo)
            reason = (f"rsv leaves an attention-TP rank no rows (DP rows {list(parts)} vs "
                      f"attn_tp={dims.attn_tp}), and a compiled graph must have every rank's "
                      "shapes: a rank's empty share makes its next collective independent of "
                      "the last, which its compiler may then issue first")
        elif dims.attn_dp > 1 or cp or scattered:
            return RowMode.RSV, "rsv"
        else:
            reason = "rsv needs attention DP or CP"
    else:
        reason = ""
    if runtime.allows_rs:
        a = dims.attn_tp
        seg = -(-max(parts) // a) * a if parts else 0
        if runtime.rs_padding or all(c == seg for c in parts):
            return RowMode.RS, "rs" if not reason else f"rs ({reason})"
        what = "CP shares" if cp else "DP rows"
        why = f"rs needs padding: {what} {list(parts)} vs attn_tp={a}, padding disallowed"
        reason = f"{reason}; {why}" if reason else why
    if scattered:
        what = (f"a {variant.value} batch" if variant in SCATTERED_VARIANTS else
                f"moe_a2a_backend={runtime.moe_a2a_backend} with attention TP {dims.attn_tp}")
        raise ValueError(f"{what} keeps its residual scattered over attention TP and has no "
                         f"ar path: {reason or 'boundary_reduction is ar'}")
    if runtime.boundary_reduction == "ar":
        return RowMode.AR, "ar"
    return RowMode.AR, f"fallback to ar ({reason})"


def layer_rows_moved(runtime, mode: RowMode, counts: tuple[int, ...]) -> float:
    """The ring-formula rows (times hidden) one rank sends per dense layer in ``mode``: the
    attention sum and the FFN sum, and, scattered, the two input gathers (an all-reduce is a
    reduce-scatter plus an all-gather). ``rs`` counts its padding."""
    dims = runtime.parallel.dims
    n, a = dims.tp, dims.attn_tp
    if mode is RowMode.AR:
        # attention sum onto the FFN's global rows, FFN sum back: two all-reduces over TP of
        # every DP rank's rows (at attn_dp 1 the attention's is over attention TP = TP)
        return 4 * (n - 1) / n * sum(counts)
    if mode is RowMode.RS:
        chunk = -(-max(counts) // a) if counts else 0
        local, total = chunk * a, chunk * a * len(counts)
    else:
        local, total = max(counts), sum(counts)
    return 2 * (n - 1) / n * total + 2 * (a - 1) / a * local


def _ar_is_cheaper(runtime, counts: tuple[int, ...]) -> str | None:
    """Why the all-reduce path serves this batch better than the scattered one the policy
    permits (None: it does not). A scattered path issues twice the collectives, so it must
    move fewer rows to be chosen; a DP rank with fewer rows than attention-TP ranks gains
    nothing from a scatter."""
    dims = runtime.parallel.dims
    mode = (RowMode.RSV if runtime.allows_rsv and dims.attn_dp > 1
            else RowMode.RS if runtime.allows_rs else None)
    if mode is None:
        return None
    widest = max(counts) if counts else 0
    if widest < dims.attn_tp:
        return (f"ar: each DP rank holds at most {widest} rows, fewer than attn_tp="
                f"{dims.attn_tp}, so a scatter gains nothing")
    ar, other = layer_rows_moved(runtime, RowMode.AR, counts), layer_rows_moved(
        runtime, mode, counts)
    if other >= ar:
        # plain str() of the figures: select_mode also runs inside a compiled forward
        return (f"ar: {mode.value} would send {round(other, 2)} rows x hidden per layer "
                f"against ar's {round(ar, 2)}, in twice the collectives")
    return None


def keeps_scattered(runtime, variant: BatchVariant) -> bool:
    """Whether every forward keeps the residual scattered over attention TP: a
    sequence-parallel batch, or a runtime whose MoEs dispatch from the residual's rows, which
    must be rows no other rank holds (with attention TP > 1, the scattered ones)."""
    return variant in SCATTERED_VARIANTS or (
        runtime.dispatches_moe and runtime.parallel.dims.attn_tp > 1)


def supported_modes(runtime, variant: BatchVariant = BatchVariant.ORDINARY) -> list[RowMode]:
    """The row modes a stage builds paths for in ``variant``: ar always (at tp=1 the only
    one), except in a sequence-parallel batch, whose residual is scattered (rs, rsv)."""
    dims = runtime.parallel.dims
    cp = variant is BatchVariant.CP
    scattered = keeps_scattered(runtime, variant)
    modes = [RowMode.AR] if dims.tp == 1 or not scattered else []
    if dims.tp > 1 and runtime.allows_rs:
        modes.append(RowMode.RS)
    if dims.tp > 1 and (dims.attn_dp > 1 or cp or scattered) and runtime.allows_rsv:
        modes.append(RowMode.RSV)
    return modes


def plan_variants(runtime) -> list[BatchVariant]:
    """The batch variants a stage builds paths for on this runtime: the ordinary one without
    attention CP, the CP one with it (CP ranks hold shares of one DP rank's tokens; an
    ordinary batch would need them to repeat each other's attention)."""
    dims = runtime.parallel.dims
    wanted = runtime.batch_variants
    if dims.attn_cp == 1:
        # the ordinary rows always; sequence-parallel and input-scattered batches where the
        # runtime runs them (a CP batch has no shares to place here: no CP path)
        return [BatchVariant.ORDINARY] + [v for v in (BatchVariant.SEQUENCE_PARALLEL,
                                                      BatchVariant.INPUT_SCATTERED)
                                          if v in wanted]
    if BatchVariant.CP not in wanted:
        raise UnsupportedBoundary(
            f"attn_cp={dims.attn_cp} splits each batch over CP ranks: the runtime's "
            "batch_variants must include BatchVariant.CP (an ordinary batch has no path on "
            "a CP topology)")
    others = [v.value for v in wanted if v not in (BatchVariant.CP, BatchVariant.ORDINARY)]
    if others:
        raise UnsupportedBoundary(f"attn_cp={dims.attn_cp}: the {', '.join(others)} batch "
                                  "variant does not combine with CP yet")
    return [BatchVariant.CP]
