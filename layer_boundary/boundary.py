"""Select and bind producer and consumer boundary operations from declarations.

Both sides of an edge are derived from the same pair of declarations: a consumer rebuilds its
producer's output decisions from its ``previous`` declaration, so it knows exactly which owed
work can arrive, and binds a movement for each. Everything here runs at construction.
"""

from __future__ import annotations

from .contracts import Owed, ProducerReduction, StageKind
from .exit import ExitDecision, ExitPath, OutputPlan
from .fusions import InputPlan
from .layout import BatchRows, RowMode, Rows, SumGroup, sum_group
from .output import completion
from .prepare import EntryPath
from .runtime.context import NO_FLAGS, ForwardFlags

DEFER_ALL_REDUCE = ForwardFlags(fuse_mlp_allreduce=True)
REDUCE_SCATTER = ForwardFlags(mlp_reduce_scatter=True)
DEFER_FINALIZE = {RowMode.AR: ForwardFlags(fuse_mlp_allreduce=True, defer_moe_finalize=True),
                  RowMode.RS: ForwardFlags(mlp_reduce_scatter=True, defer_moe_finalize=True),
                  RowMode.RSV: ForwardFlags(mlp_reduce_scatter=True, defer_moe_finalize=True)}


def update_rows(mode: RowMode) -> Rows:
    """Where the residual lives between stages in ``mode``."""
    return Rows.LOCAL if mode is RowMode.AR else Rows.SCATTERED


def compute_rows(decl) -> Rows:
    """Attention computes on its DP rank's rows; a dense FFN on every DP rank's rows."""
    return Rows.LOCAL if decl.kind is StageKind.ATTN else Rows.GLOBAL


def _owed(runtime, which: SumGroup, rows: Rows) -> Owed | None:
    return Owed(which, rows) if sum_group(runtime.parallel, which).size > 1 else None


def make_output_boundary(decl, following, runtime, mode: RowMode = RowMode.AR,
                         fusions=None, name: str = "") -> ExitPath:
    """Bind a producer's output transport: the handoff ``decl`` leaves for ``following``."""
    dims = runtime.parallel.dims
    if decl.kind is StageKind.ATTN:
        owed = _owed(runtime, SumGroup.ATTN_TP, Rows.LOCAL)
        if owed is None:
            return ExitPath(ExitDecision(NO_FLAGS, None, Rows.LOCAL, "complete (attn_tp=1)"))
        if decl.reduction is ProducerReduction.PARTIAL:
            return ExitPath(ExitDecision(NO_FLAGS, owed, Rows.LOCAL, "partial: attn_tp sum owed"))
        # A single-stage mixer always leaves its sum to an FFN's input, and to another mixer's
        # input only where that input can all-reduce it (never under attention DP).
        if following is not None and following.kind is StageKind.FFN:
            return ExitPath(ExitDecision(DEFER_ALL_REDUCE, owed, Rows.LOCAL,
                                         "attn_tp sum left to FFN input"))
        if (following is not None and not decl.terminal and runtime.allreduce_fusion
                and dims.attn_dp == 1):
            return ExitPath(ExitDecision(DEFER_ALL_REDUCE, owed, Rows.LOCAL,
                                         "attn_tp sum left to mixer input"))
        return ExitPath(ExitDecision(NO_FLAGS, None, Rows.LOCAL, "all_reduce(attn_tp) in compute"))

    default = _ffn_exit(decl, following, runtime, mode)
    if fusions is None:
        return ExitPath(default)
    plan = OutputPlan(name, decl, mode)
    owed = _owed(runtime, _ffn_sum(decl), Rows.GLOBAL)
    if decl.sparse:
        # the provider decides per batch whether compute may return a finalize handoff
        deferred = ExitDecision(DEFER_FINALIZE[mode], owed, Rows.GLOBAL,
                                "finalize + sum handed to next input")
        return ExitPath(default, deferred, lambda fb: fusions.can_defer_finalize(plan, fb))
    if decl.reduction is ProducerReduction.LOCAL_TAIL and mode is RowMode.AR:
        deferred = ExitDecision(DEFER_ALL_REDUCE, owed, Rows.GLOBAL,
                                "all_reduce(tp) deferred to next input (provider)")
        return ExitPath(default, deferred, lambda fb: fusions.can_defer_all_reduce(plan, fb))
    return ExitPath(default)


def _ffn_sum(decl) -> SumGroup:
    return SumGroup.MOE_OUT if decl.sparse else SumGroup.TP


def _ffn_exit(decl, following, runtime, mode: RowMode) -> ExitDecision:
    """An FFN's output decision without a fusion provider."""
    dims = runtime.parallel.dims
    owed = _owed(runtime, _ffn_sum(decl), Rows.GLOBAL)
    back = None if dims.attn_dp == 1 else BatchRows.global_to_local
    if owed is None:
        return ExitDecision(NO_FLAGS, None, Rows.LOCAL, "complete (tp=1)", back)
    if mode is not RowMode.AR:
        # compute skips its sum; the consumer reduce-scatters it onto scattered rows
        # (LOCAL_TAIL keeps this permission: its tail must then be added on one rank)
        kind = "reduce_scatter" if mode is RowMode.RS else "reduce_scatter_v"
        return ExitDecision(REDUCE_SCATTER, owed, Rows.GLOBAL, f"{kind}(tp) left to next input")
    # LOCAL_TAIL adds its tail after its own sum, so that sum is not deferred by default.
    if (decl.reduction is ProducerReduction.SCOPED and not decl.terminal
            and following is not None and runtime.allreduce_fusion):
        return ExitDecision(DEFER_ALL_REDUCE, owed, Rows.GLOBAL,
                            "all_reduce(tp) deferred to next input")
    label = "all_reduce(tp) in compute" + ("" if back is None else " -> slice to local rows")
    return ExitDecision(NO_FLAGS, None, Rows.LOCAL, label, back)


def static_owed(runtime, decl) -> Owed | None:
    """The sum ``decl``'s producer always leaves (a pipeline receiver re-declares it)."""
    prev = decl.previous
    if prev is None or prev.kind is not StageKind.ATTN:
        return None
    if prev.reduction is ProducerReduction.PARTIAL or decl.kind is StageKind.FFN:
        return _owed(runtime, SumGroup.ATTN_TP, Rows.LOCAL)
    return None


def make_boundary(name: str, decl, norm, runtime, mode: RowMode = RowMode.AR,
                  qkv_latent_func=None, fusions=None) -> EntryPath:
    """Bind a consumer's input work in ``mode``: a movement for every output its producer may
    leave, the residual update rows, and the move to compute's rows. An attention's
    ``qkv_latent_func`` runs on the read's rows, before any gather, so only the (smaller)
    latent moves."""
    target = update_rows(mode)
    arrivals = {}
    producer_keys = []
    if decl.previous is not None:
        for decision in make_output_boundary(decl.previous, decl, runtime, mode,
                                             fusions).decisions:
            key = (None if decision.owed is None else decision.owed.group,
                   decision.rows if decision.finish_move is None else Rows.LOCAL)
            arrivals[key] = completion(key[0], key[1], target)
            producer_keys.append(key)
        # accessors (complete_output, add_to_output) may finish the sum before this input
        arrivals.setdefault((None, Rows.LOCAL), completion(None, Rows.LOCAL, target))
        arrivals.setdefault((None, target), completion(None, target, target))
    static = static_owed(runtime, decl)
    if static is not None:
        arrivals.setdefault((static.group, static.rows), completion(static.group, static.rows, target))
    dims = runtime.parallel.dims
    sum_before_read = (mode is RowMode.AR and dims.attn_dp > 1 and decl.kind is StageKind.FFN
                       and not decl.residual.read.before_gather)
    candidates = ()
    if fusions is not None:
        plan = InputPlan(name, decl.kind.value, mode, target, compute_rows(decl),
                         runtime.parallel)
        offer = fusions.attention_input if decl.kind is StageKind.ATTN else fusions.ffn_input
        candidates = tuple(offer(plan))
    return EntryPath(name, mode, decl.residual.read, norm, stack_entry=decl.previous is None,
                     update_rows=target, compute_rows=compute_rows(decl), arrivals=arrivals,
                     producer_keys=tuple(producer_keys), sum_before_read=sum_before_read,
                     attn_dp=dims.attn_dp, latent=qkv_latent_func, candidates=candidates)
