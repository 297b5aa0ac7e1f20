"""Select and bind producer and consumer boundary operations from contracts.

Both sides of an edge are bound from the same contract: a consumer rebuilds its producer's
``StageOutput`` from its ``previous`` declaration and binds the same exit decisions the
producer binds, so it knows exactly which owed work can arrive, and takes a movement from the
table for each. Everything here runs at construction.
"""

from __future__ import annotations

from dataclasses import replace

from .contracts import EdgeDecl, ProducerReduction, StageKind, StageOutput
from .exit import ExitDecision, ExitPath, OutputPlan
from .fusions import InputPlan
from .layout import Layouts, RowMode, SumGroup, sum_group
from .prepare import ArrivalPath, EntryPath
from .residual import ReadKind, is_plain, read_kind
from .residual.stream import arrival_key
from .runtime.context import NO_FLAGS, ForwardFlags, SequenceParallelMoves

DEFER_ALL_REDUCE = ForwardFlags(fuse_mlp_allreduce=True)
REDUCE_SCATTER = ForwardFlags(mlp_reduce_scatter=True)


def _defer_finalize(mode: RowMode, owes: bool) -> ForwardFlags:
    if not owes:
        return ForwardFlags(defer_moe_finalize=True)
    if mode is RowMode.AR:
        return ForwardFlags(fuse_mlp_allreduce=True, defer_moe_finalize=True)
    return ForwardFlags(mlp_reduce_scatter=True, defer_moe_finalize=True)


def bind_exit(output: StageOutput, mode: RowMode, table: dict, *, fusions=None,
              name: str = "", declaration=None) -> ExitPath:
    """The decisions a producer's exit may take in ``mode``, from its output contract."""
    group, rows = output.sum_group, output.rows
    if output.linears_sum is not None:
        return _sequence_parallel_exit(output, table, fusions, OutputPlan(name, declaration, mode))
    handoff = table.lookup(None, rows, output.handoff_rows)
    finish_move = handoff if handoff.moves else None

    def complete(label: str, compute_sum=None) -> ExitDecision:
        if finish_move is not None:
            label += f" -> {finish_move.name}"
        return ExitDecision(NO_FLAGS, None, rows, label, finish_move=handoff,
                            compute_sum=compute_sum)

    if output.dispatches:
        default = complete("complete: all_to_all(tp) dispatch and combine in compute")
    elif group is None:
        default = complete(f"complete ({output.kind.value} sum group of size 1)")
    elif output.reduction is ProducerReduction.PARTIAL:
        default = ExitDecision(NO_FLAGS, group, rows, f"partial: {group.value} sum owed",
                               declared=True)
    else:
        scatter = output.kind is StageKind.FFN and mode is not RowMode.AR
        leaves = output.leaves_for_reduce_scatter if scatter else output.leaves_for_all_reduce
        if leaves:
            how = "reduce-scatter" if scatter else "all-reduce"
            consumer = "final norm" if output.terminal else "next input"
            default = ExitDecision(REDUCE_SCATTER if scatter else DEFER_ALL_REDUCE, group, rows,
                                   f"{group.value} sum left to the {consumer} ({how})")
        else:
            compute_sum = table.lookup(group, rows, rows)
            default = complete(f"{compute_sum.name} in compute", compute_sum)
    completed = complete("complete in compute (postprocess)")

    if fusions is None:
        return ExitPath(default, at_producer=output.at_producer, completed=completed)
    # the provider's questions, asked per batch in this order (spec: can_defer_finalize on
    # every FFN exit that has a provider; can_defer_all_reduce for a LOCAL_TAIL FFN whose sum
    # is a single all-reduce over the TP group)
    plan = OutputPlan(name, declaration, mode)
    choices = []
    if output.hands_off_finalize:
        handoff = ExitDecision(_defer_finalize(mode, group is not None), group, rows,
                               "finalize" + (f" + {group.value} sum" if group else "")
                               + " handed to the next input", hands_off=True)
        choices.append((lambda fb: fusions.can_defer_finalize(plan, fb), handoff))
    if output.provider_defers_all_reduce and mode is RowMode.AR and group is not None:
        deferred = ExitDecision(DEFER_ALL_REDUCE, group, rows,
                                f"{group.value} sum left to the next input (provider)")
        choices.append((lambda fb: fusions.can_defer_all_reduce(plan, fb), deferred))
    return ExitPath(default, tuple(choices), at_producer=output.at_producer,
                    completed=completed, issues_early=False)


def _sequence_parallel_exit(output: StageOutput, table, fusions, plan: OutputPlan) -> ExitPath:
    """A sequence-parallel stage's exit: its scope publishes the two movements its linears
    run (gather the scattered input onto the linears' rows, reduce-scatter the partial
    output back); the output is complete on the scattered rows, so nothing is owed after
    it. An FFN with a provider asks ``can_defer_finalize`` (spec: every FFN exit); a yes
    lets compute return its finalize on the scattered rows, handed on complete."""
    parallel = table.parallel
    group = sum_group(parallel, output.linears_sum)
    owed = output.linears_sum if group.size > 1 else None
    gather = table.lookup(None, output.rows, output.linears_rows)
    scatter = table.lookup(owed, output.linears_rows, output.rows)
    flags = ForwardFlags(sequence_parallel=SequenceParallelMoves(gather, scatter, group))
    decision = ExitDecision(flags, None, output.rows,
                            f"sequence-parallel compute: {gather.name} in, {scatter.name} out")
    completed = ExitDecision(NO_FLAGS, None, output.rows, "complete in compute (postprocess)")
    if not output.hands_off_finalize:
        return ExitPath(decision, at_producer=output.at_producer, completed=completed)
    handoff = ExitDecision(replace(flags, defer_moe_finalize=True), None, output.rows,
                           decision.label + "; finalize handed to the next input",
                           hands_off=True)
    choices = ((lambda fb: fusions.can_defer_finalize(plan, fb), handoff),)
    return ExitPath(decision, choices, at_producer=output.at_producer, completed=completed,
                    issues_early=False)


def bind_entry(name: str, edge: EdgeDecl, producer_exit: ExitPath | None, decl, norm,
               mode: RowMode, table: dict, *, parallel=None, qkv_latent_func=None,
               fusions=None, latent_first: bool = False) -> EntryPath:
    """Bind a consumer's input work in ``mode``: a movement for every output its producer may
    leave (and for the complete values accessors leave on local rows), the residual's
    alignment, and the move to compute's rows. An attention's ``qkv_latent_func`` runs on the
    compute rows, after the input's gather; with ``latent_first`` (an input-scattered batch)
    on the read's rows, before any gather, so only the (smaller) latent moves."""
    layouts: Layouts = table.layouts
    target, compute, local = edge.residual_dst, edge.consumer.rows, layouts.local
    read = decl.residual.read
    candidates = ()
    if fusions is not None:
        plan = InputPlan(name, decl.kind, mode, layouts, target, compute, parallel, table,
                         read)
        offer = fusions.attention_input if decl.kind is StageKind.ATTN else fusions.ffn_input
        candidates = tuple(offer(plan))
    arrivals, producer_keys = {}, []
    decisions = producer_exit.decisions if producer_exit is not None else ()
    declared_plain = edge.producer is not None and is_plain(decl.previous.residual.update)
    for decision in decisions:
        for key in decision.arrivals():
            producer_keys.append(key)
            arrivals[key] = _arrival(key, decision, target, mode, table, layouts, candidates,
                                     declared_plain, read, decl)
    # complete values: what accessors and output transforms leave (local rows) and captures
    # complete (update rows); a candidate that takes a complete value from those rows is
    # offered them too
    for rows in (local, target):
        key = arrival_key(None, rows, False)
        if key not in arrivals:
            applying = tuple(c for c in candidates
                             if c.applies(None, rows, False, target, mode, declared_plain,
                                          read_kind(read)))
            arrivals[key] = ArrivalPath(key, table.lookup(None, rows, target), applying)
    # the residual arrives where the edge says (local rows at stack entry), or on local rows
    # where the model wrote it itself (written())
    align = {rows.key: table.lookup(None, rows, target)
             for rows in (edge.residual_src, local, target)}
    return EntryPath(
        stage=name, mode=mode, read=read, norm=norm, latent=qkv_latent_func,
        stack_entry=decl.previous is None,
        local=local, update_rows=target, compute_rows=compute, arrivals=arrivals,
        producer_keys=tuple(dict.fromkeys(producer_keys)), align=align,
        enter_residual=table.lookup(None, local, target),
        enter_input=table.lookup(None, local, compute),
        input_move=table.lookup(None, target, compute),
        local_to_update=table.lookup(None, local, target),
        capture_move=table.lookup(None, target, local), residual_src=edge.residual_src,
        declared=next((d for d in decisions if d.declared), None), latent_first=latent_first,
        assumes_plain=declared_plain, beside=decl.parallel,
        beside_shares_input=decl.parallel and compute == layouts.attention and not table.cp)


def _arrival(key, decision: ExitDecision, target, mode, table, layouts, candidates,
             declared_plain: bool, read, decl) -> ArrivalPath:
    handoff = key[2]
    if decision.finish_move is not None:
        owed, src = None, decision.finish_move.dst
    else:
        owed, src = decision.owed, decision.rows
    complete = table.lookup(owed, src, target)
    applying = tuple(c for c in candidates
                     if c.applies(owed, src, handoff, target, mode, declared_plain,
                                  read_kind(read)))
    sum_before_read = None
    # attention DP (not in a CP batch, whose shares are no DP segment), a plain update and
    # the add+norm read (its update_and_read is an add then a read, which this reorders), an
    # FFN consumer: add the residual on one
    # attention-TP rank before the sum, and one TP all-reduce brings every DP rank's updated
    # rows (an attention partial: placed in a zero global buffer; an FFN's: already global)
    if (mode is RowMode.AR and not handoff and decl.kind is StageKind.FFN and not table.cp
            and layouts.local != layouts.replicated and declared_plain
            and read_kind(read) is ReadKind.ADD_NORM and not read.before_gather
            and ((owed is SumGroup.ATTN_TP and src == layouts.attention)
                 or (owed in (SumGroup.TP, SumGroup.MOE_OUT) and src == layouts.replicated))):
        sum_before_read = table.lookup(owed, src, layouts.replicated)
    return ArrivalPath(key, complete, applying, sum_before_read)
