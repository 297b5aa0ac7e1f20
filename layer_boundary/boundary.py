"""Select and bind producer and consumer boundary operations from declarations.

Both sides of an edge are derived from the same pair of declarations: a consumer rebuilds its
producer's output decisions from its ``previous`` declaration, so it knows exactly which owed
work can arrive and binds a completion for each.
"""

from __future__ import annotations

from .contracts import ProducerReduction, StageKind
from .exit import ExitDecision, ExitPath
from .layout import REPLICATED, SumGroup
from .output import all_reduce_completion, sum_owed
from .prepare import EntryPath
from .runtime.context import NO_FLAGS, ForwardFlags

DEFER_ALL_REDUCE = ForwardFlags(fuse_mlp_allreduce=True)


def make_output_boundary(decl, following, runtime) -> ExitPath:
    """Bind a producer's output transport: the handoffs ``decl`` may leave for ``following``."""
    parallel = runtime.parallel
    if decl.kind is StageKind.ATTN:
        owed = sum_owed(parallel, SumGroup.ATTN_TP, REPLICATED)
        if owed is None:
            return ExitPath(ExitDecision(NO_FLAGS, None, "complete (attn_tp=1)"))
        if decl.reduction is ProducerReduction.PARTIAL:
            return ExitPath(ExitDecision(NO_FLAGS, owed, "partial: attn_tp sum owed"))
        # A single-stage mixer always leaves its sum to an FFN's input, and to another mixer's
        # input only where that input can all-reduce it (never under attention DP).
        if following is not None and following.kind is StageKind.FFN:
            return ExitPath(ExitDecision(DEFER_ALL_REDUCE, owed, "attn_tp sum left to FFN input"))
        if (following is not None and not decl.terminal and runtime.allreduce_fusion
                and parallel.dims.attn_dp == 1):
            return ExitPath(ExitDecision(DEFER_ALL_REDUCE, owed, "attn_tp sum left to mixer input"))
        return ExitPath(ExitDecision(NO_FLAGS, None, "all_reduce(attn_tp) in compute"))

    owed = sum_owed(parallel, SumGroup.TP, REPLICATED)
    if owed is None:
        return ExitPath(ExitDecision(NO_FLAGS, None, "complete (tp=1)"))
    # LOCAL_TAIL adds its tail after its own sum, so that sum is never deferred.
    if (decl.reduction is ProducerReduction.SCOPED and not decl.terminal
            and following is not None and runtime.allreduce_fusion):
        return ExitPath(ExitDecision(DEFER_ALL_REDUCE, owed, "all_reduce(tp) deferred to next input"))
    return ExitPath(ExitDecision(NO_FLAGS, None, "all_reduce(tp) in compute"))


def static_owed(runtime, decl):
    """The sum ``decl``'s producer always leaves (a pipeline receiver re-declares it)."""
    prev = decl.previous
    if prev is None or prev.kind is not StageKind.ATTN:
        return None
    if prev.reduction is ProducerReduction.PARTIAL or decl.kind is StageKind.FFN:
        return sum_owed(runtime.parallel, SumGroup.ATTN_TP, REPLICATED)
    return None


def make_boundary(name: str, decl, norm, runtime) -> EntryPath:
    """Bind a consumer's input work: a completion for every owed sum its producer may leave."""
    completions = {}
    if decl.previous is not None:
        for decision in make_output_boundary(decl.previous, decl, runtime).decisions:
            if decision.owed is not None:
                completions[decision.owed] = all_reduce_completion(decision.owed)
    static = static_owed(runtime, decl)
    if static is not None:
        completions.setdefault(static, all_reduce_completion(static))
    return EntryPath(name, decl.residual.read, norm, stack_entry=decl.previous is None,
                     completions=completions)
