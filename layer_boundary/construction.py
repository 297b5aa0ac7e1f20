"""Build a ``StagePlan`` at construction and select its batch variant at forward.

Construction resolves a declaration into contracts for every supported batch variant and row
mode (``StageDecl``, ``EdgeDecl``), binds the exit and entry paths from them, and rejects
what it cannot run. A forward only computes its row facts once and picks a prebuilt path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import parallel_block
from .boundary import bind_entry, bind_exit
from .contracts import (BatchVariant, EdgeDecl, PathKey, ProducerReduction, StageDecl, StageInput,
                        StageKind, StageOutput)
from .exit import ExitPath
from .layout import Layouts, RowMode, SumGroup, TokenAxis, sum_group
from .ops import Movement, RowFacts, UnsupportedBoundary, cp_share_sizes, movement_table
from .prepare import EntryPath
from .residual import needs_token_rows
from .row_modes import SCATTERED_VARIANTS, plan_variants, select_mode, supported_modes
from .residual.stream import START_FIRST

__all__ = ["StagePlan", "StagePath", "UnsupportedBoundary", "build_plan", "select_mode",
           "supported_modes", "resolve_output", "resolve_input", "no_path_error"]


def no_path_error(variant: BatchVariant) -> RuntimeError:
    return RuntimeError(f"no stage boundary path for the active {variant.value} batch")


CP_NEEDS_LENS = ("a CP batch under attention DP needs every DP rank's request lengths "
                 "(ForwardBatch.dp_request_lens): they place its CP shares")


def cp_request_lens(forward_batch, counts: tuple[int, ...], dp_rank: int) -> tuple:
    """Every DP rank's request lengths in a CP batch (its CP mapping's input), checked
    against the batch's counts and this rank's own requests."""
    lens = forward_batch.dp_request_lens
    if lens is None:
        if len(counts) > 1:
            raise ValueError(CP_NEEDS_LENS)
        lens = (tuple(forward_batch.extend_lens),)
    lens = tuple(tuple(per_dp) for per_dp in lens)
    if (len(lens) != len(counts) or any(sum(per) != c for per, c in zip(lens, counts))
            or lens[dp_rank] != tuple(forward_batch.extend_lens)):
        raise ValueError(f"ForwardBatch.dp_request_lens {lens} does not describe the CP batch: "
                         f"DP token counts {counts}, this DP rank's requests "
                         f"{tuple(forward_batch.extend_lens)}")
    return lens


@dataclass(frozen=True)
class StagePath:
    decl: StageDecl
    edge: EdgeDecl
    entry: EntryPath
    exit: ExitPath
    # a prepared branch's entry: the source's prepared input onto this stage's compute rows
    branch_in: Movement | None = None


def _sum(runtime, which: SumGroup) -> SumGroup | None:
    return which if sum_group(runtime.parallel, which).size > 1 else None


def handoff_rows(decl, layouts: Layouts, mode: RowMode):
    """Where a complete FFN output is handed on (a plain scatter of its rows): the attention
    rows (this DP rank's, or its CP share), or, between two sparse FFNs (``sparse`` with
    ``next_sparse``: the layer after the consumer is sparse too, as between MoE layers), the
    residual's rows in ``mode``, so the rows two-batch overlap splits and merges stay
    token-sharded across the pair."""
    if decl.sparse and decl.next_sparse:
        return layouts.residual(mode)
    return layouts.attention


def _sequence_parallel(decl, variant: BatchVariant) -> bool:
    """The stage computes on scattered rows with its linears moving them (a
    sequence-parallel batch, and a declaration whose compute honours it)."""
    return variant is BatchVariant.SEQUENCE_PARALLEL and decl.sequence_parallel


def resolve_output(decl, following, runtime, layouts: Layouts, fusions=None,
                   mode: RowMode = RowMode.AR,
                   variant: BatchVariant = BatchVariant.ORDINARY) -> StageOutput:
    """A declaration's output contract: its rows, its sum, and the handoffs it may take."""
    at_producer = decl.residual.update.at_producer
    if _sequence_parallel(decl, variant):
        # the row-parallel linear reduce-scatters onto the scattered rows: complete there
        attn = decl.kind is StageKind.ATTN
        return StageOutput(decl.kind, layouts.scattered, decl.reduction, None, layouts.scattered,
                           at_producer=at_producer, next_sparse=decl.next_sparse,
                           linears_sum=SumGroup.ATTN_TP if attn else SumGroup.TP,
                           linears_rows=layouts.attention if attn else layouts.replicated,
                           hands_off_finalize=fusions is not None and not attn)
    if decl.dispatches:
        # the combine brings every expert's contribution back to the row it came from:
        # complete on the residual's rows, nothing owed; a provider may take its finalize
        rows = layouts.residual(mode)
        return StageOutput(StageKind.FFN, rows, decl.reduction, None, rows,
                           at_producer=at_producer, next_sparse=decl.next_sparse,
                           hands_off_finalize=fusions is not None, dispatches=True)
    known = following is not None and not decl.terminal  # a consumer that can finish a sum
    if decl.kind is StageKind.ATTN:
        if decl.reduction is ProducerReduction.PARTIAL:
            leaves = True
        elif known and following.kind is StageKind.FFN:
            leaves = True  # a mixer always leaves its sum to an FFN's input
        else:  # to another mixer's input only where it can all-reduce it
            leaves = (known and runtime.allreduce_fusion and runtime.parallel.dims.attn_dp == 1)
        leaves = leaves and (decl.reduction is ProducerReduction.PARTIAL or not at_producer)
        return StageOutput(StageKind.ATTN, layouts.attention, decl.reduction,
                           _sum(runtime, SumGroup.ATTN_TP), layouts.attention,
                           leaves_for_all_reduce=leaves, leaves_for_reduce_scatter=leaves,
                           at_producer=at_producer)
    known = known and not at_producer
    if decl.parallel:
        # the attention's partial joins this FFN's sum at its finish: the sum is always left
        # to the next input (or the final norm), and no provider takes it over
        return StageOutput(StageKind.FFN, layouts.replicated, decl.reduction,
                           _sum(runtime, SumGroup.TP), layouts.attention,
                           leaves_for_all_reduce=True, leaves_for_reduce_scatter=True,
                           next_sparse=decl.next_sparse, terminal=decl.terminal)
    scoped = decl.reduction is ProducerReduction.SCOPED
    # LOCAL_TAIL adds its tail after its own sum: never deferred to an all-reduce by default,
    # but its reduce-scatter permission stays (compute then adds the tail on one rank)
    return StageOutput(
        StageKind.FFN, layouts.replicated, decl.reduction,
        _sum(runtime, SumGroup.MOE_OUT if decl.sparse else SumGroup.TP),
        handoff_rows(decl, layouts, mode),
        leaves_for_all_reduce=known and scoped and runtime.allreduce_fusion,
        # the final norm completes an owed sum on the residual's rows as an entry would (a
        # reduce-scatter there, the norm on the slice, one gather to local rows): the
        # analytic minimum under attention DP, where an all-reduce would move twice the rows
        leaves_for_reduce_scatter=known or (decl.terminal and not at_producer),
        # every FFN exit with a provider asks it (spec); a transform before the sum then
        # runs on the handoff's completion (``output.TransformedHandoff``)
        hands_off_finalize=fusions is not None,
        provider_defers_all_reduce=(not scoped and known and fusions is not None),
        at_producer=at_producer, next_sparse=decl.next_sparse, terminal=decl.terminal)


def resolve_input(decl, runtime, layouts: Layouts,
                  variant: BatchVariant = BatchVariant.ORDINARY,
                  mode: RowMode = RowMode.AR) -> StageInput:
    """A declaration's input contract: its compute rows and the sum its producer always leaves."""
    prev = decl.previous
    static = None
    if prev is not None and prev.kind is StageKind.ATTN and not _sequence_parallel(
            prev, variant) and (
            prev.reduction is ProducerReduction.PARTIAL or decl.kind is StageKind.FFN):
        static = _sum(runtime, SumGroup.ATTN_TP)
    if _sequence_parallel(decl, variant):  # compute takes the scattered rows as they are
        return StageInput(layouts.scattered, static)
    if decl.dispatches:  # the MoE moves its routed tokens itself: the residual's rows
        return StageInput(layouts.residual(mode), static)
    if decl.kind is StageKind.ATTN:
        gathers = frozenset({TokenAxis.ATTN_TP_SCATTER}) if (
            decl.gathers_tp_input and runtime.parallel.dims.attn_tp > 1) else frozenset()
        return StageInput(layouts.attention, static, gathers)
    return StageInput(layouts.replicated, static)


def _constant_result(fn):
    """``torch.compiler.assume_constant_result``, without importing torch's compiler with the
    package (about 1.7 s of CPU in every process that imports it: each rank, the command
    line): it sets the mark dynamo reads (torch 2.13; tests/test_compile.py checks it is
    the one torch's decorator sets)."""
    fn._dynamo_marked_constant = True
    return fn


class StagePlan:
    """Every path a stage supports, per batch variant and row mode, built once."""

    __slots__ = ("name", "declaration", "paths", "runtime", "tables", "by_key", "variants",
                 "_mixer", "_placed", "_traced")

    PLACED_KEPT = 64  # placements kept by DP token counts (the oldest leaves first)

    def __init__(self, name: str, declaration, paths: dict, runtime, tables: dict) -> None:
        self.name, self.declaration, self.paths, self.runtime = name, declaration, paths, runtime
        # what plans print beside the stage's name, where its declaration names its mixer
        mixer = declaration.mixer
        self._mixer = {} if mixer is None else {"mixer": mixer}
        self.tables = tables  # (batch variant, row mode) -> the movement table
        # the same paths keyed by plain strings, which a forward hashes cheaply
        self.by_key = {PathKey(variant.value, mode.value): path
                       for (variant, mode), path in paths.items()}
        self.variants = frozenset(variant for variant, _ in paths)
        # counts -> (variant, tokens, facts, path key) of a forward placed before, outside CP:
        # the same counts place the same rows and the same mode
        self._placed: dict = {}
        # the same, for the shapes a static-shape compiled forward traced (never evicted)
        self._traced: dict = {}

    def place(self, forward_batch) -> RowFacts:
        """This forward's row facts; the first boundary of a forward places them for all."""
        state = forward_batch.boundary
        if state is None:
            raise RuntimeError(START_FIRST)
        counts = tuple(forward_batch.dp_token_counts)
        facts = state.facts
        if facts is not None:
            if facts.counts != counts:
                raise ValueError(f"ForwardBatch.dp_token_counts changed to {counts} inside a "
                                 f"forward whose rows were placed for {facts.counts}; start "
                                 "the layer stack again (residual_batch.start) for new counts")
            if state.runtime is not self.runtime:
                raise ValueError(f"stage {self.name} was built on another runtime than the "
                                 "stages this forward already ran (one forward, one "
                                 "BoundaryRuntime)")
            return facts
        variant = forward_batch.variant
        # decided once per forward: no adapter runs and no sum is issued early
        state.plain = forward_batch.lora_ids is None and not forward_batch.overlap
        # a static-shape trace (compile_forward(padded=True)) sees the counts as ints; under
        # automatic dynamic shapes they may be symbolic, and no constant can be kept
        if torch.compiler.is_compiling() and not torch._dynamo.config.automatic_dynamic_shapes:
            self._place_while_tracing(variant, counts)
            placed = self._traced.get(counts)
        else:
            placed = self._placed.get(counts)
        if (placed is not None and placed[0] is variant
                and placed[1] == forward_batch.num_tokens):
            state.facts, state.runtime, state.path_key = placed[2], self.runtime, placed[3]
            return placed[2]
        dims = self.runtime.parallel.dims
        dp_rank = self._dp_rank()
        if len(counts) != dims.attn_dp or counts[dp_rank] != forward_batch.num_tokens:
            raise ValueError(
                f"ForwardBatch.dp_token_counts {counts} does not describe this rank: it needs "
                f"one count per attention-DP rank ({dims.attn_dp}), and this DP rank "
                f"({dp_rank}) holds {forward_batch.num_tokens} tokens")
        if variant not in self.variants:
            raise no_path_error(variant)
        lens = parts = None
        if variant is BatchVariant.CP:
            lens = cp_request_lens(forward_batch, counts, dp_rank)
            parts = tuple(n for per_dp in lens for n in cp_share_sizes(per_dp, dims.attn_cp))
        placed = self._placement(variant, counts, forward_batch.num_tokens, parts, lens)
        if placed is None:
            raise no_path_error(variant)
        state.facts, state.runtime, state.path_key = placed[2], self.runtime, placed[3]
        if lens is None:
            if len(self._placed) >= self.PLACED_KEPT:
                self._placed.pop(next(iter(self._placed)))
            self._placed[counts] = placed
        return placed[2]

    def _dp_rank(self) -> int:
        """This rank's attention-DP rank (0 without attention DP)."""
        dims = self.runtime.parallel.dims
        return self.runtime.parallel.attn_dp_rank if dims.attn_dp > 1 else 0

    def _placement(self, variant, counts: tuple, tokens: int, parts=None,
                   lens=None) -> tuple | None:
        """(variant, tokens, row facts, path key) of a forward of these counts (``tokens``
        of them this rank's; a CP batch's ``parts`` and ``lens``) in the row mode chosen for
        them, or None where this stage has no path for that mode."""
        mode, _ = select_mode(self.runtime, counts, parts, cp=lens is not None,
                              variant=variant)
        table = self.tables.get((variant, mode))
        if table is None:
            return None
        return variant, tokens, table.facts(counts, lens), PathKey(variant.value, mode.value)

    @_constant_result
    def _place_while_tracing(self, variant, counts: tuple) -> bool:
        """Keep the placement of these counts (in ``_traced``) before a static-shape trace
        reads it, so the graph takes a kept placement: a miss traced into the graph would
        rebuild the row facts and replay the insertion on every call (the boundary guard
        filter drops the guards on these caches but keeps the kept entry's token count). Runs
        at trace time only, as a constant; counts the forward will refuse are left alone.
        Never evicted, unlike eager placements: one entry per traced shape, which the
        recompile limit bounds, and an eager forward of many other shapes cannot push out the
        entry a graph reads."""
        dims = self.runtime.parallel.dims
        if (variant is BatchVariant.CP or variant not in self.variants
                or len(counts) != dims.attn_dp or counts in self._traced):
            return False
        placed = self._placement(variant, counts, counts[self._dp_rank()])
        if placed is None:
            return False
        self._traced[counts] = placed
        return True

    def select(self, forward_batch) -> tuple[StagePath, RowFacts]:
        """The prebuilt path of this forward's batch variant and row mode, and its facts."""
        state = forward_batch.boundary
        facts = None if state is None else state.facts
        if (facts is None or facts.counts != forward_batch.dp_token_counts
                or state.runtime is not self.runtime):
            facts = self.place(forward_batch)  # places the rows, or names the misuse
            state = forward_batch.boundary
        path = self.by_key.get(state.path_key)
        if path is None:
            raise no_path_error(forward_batch.variant)
        return path, facts

    @property
    def variant(self) -> BatchVariant:
        """The batch variant an unmarked batch takes here: ordinary, or CP on a CP topology."""
        return next(iter(self.paths))[0]

    def path(self, mode: RowMode) -> StagePath:
        """The path of this plan's variant in row mode ``mode``."""
        return self.paths[(self.variant, mode)]

    def describe(self, mode: RowMode = RowMode.AR, variant: BatchVariant | None = None) -> dict:
        path = self.paths.get((variant or self.variant, mode))
        if path is None:
            return {"stage": self.name, **self._mixer, "entry": "unsupported",
                    "exit": "unsupported"}
        entry = path.entry.describe()
        if path.branch_in is not None:
            entry = (f"branch_input from the prepared {self.declaration.prepared_from.describe()}"
                     f" input: {path.branch_in.name}")
        exit_ = " | ".join(d.label for d in path.exit.decisions)
        transform = self.declaration.output_transform
        if transform is not None:  # where the contribution is processed before the update
            exit_ = f"{transform.name} {transform.order}; {exit_}"
        return {"stage": self.name, **self._mixer, "kind": self.declaration.describe(),
                "residual": str(path.edge.residual_dst), "compute": str(path.decl.input.rows),
                "entry": entry, "exit": exit_}


def build_plan(name: str, declaration, norm, following, runtime, qkv_latent_func=None,
               fusions=None) -> StagePlan:
    if qkv_latent_func is not None and not declaration.gathers_tp_input:
        raise UnsupportedBoundary(
            f"stage {name}: qkv_latent_func runs inside the attention's own input gather, "
            "and a declaration with gathers_tp_input=False has none")
    if declaration.prepared_from is not None and declaration.output_transform is not None:
        raise UnsupportedBoundary(f"stage {name}: a branch's entry stage takes no "
                                  "output_transform (declare it on a stage of the main stack)")
    for variant in runtime.batch_variants:
        # an input-scattered batch moves ordinary token rows (only where an attention's latent
        # runs differs): a branch may take it
        if declaration.prepared_from is not None and variant not in (
                BatchVariant.ORDINARY, BatchVariant.INPUT_SCATTERED):
            raise UnsupportedBoundary(
                f"branch transport supports ordinary token rows only: stage {name} cannot "
                f"run the {variant.value} batch")
    try:
        variants = plan_variants(runtime)
    except UnsupportedBoundary as exc:
        raise UnsupportedBoundary(f"stage {name}: {exc}") from None
    if declaration.parallel:
        parallel_block.check(name, declaration, variants)
    _check_token_rows(name, declaration, variants)
    if declaration.dispatches:
        if not runtime.dispatches_moe:
            raise UnsupportedBoundary(
                f"stage {name} dispatches its routed tokens itself (declare_ffn(dispatches="
                "True)), and the runtime's moe_a2a_backend is 'none': build it with "
                "moe_a2a_backend='all_to_all'")
        others = [v.value for v in variants if v not in (BatchVariant.ORDINARY,
                                                         BatchVariant.INPUT_SCATTERED)]
        if others:
            raise UnsupportedBoundary(
                f"stage {name} dispatches its routed tokens from the residual's rows; its "
                f"{', '.join(others)} batch paths are not built yet")
    paths, tables = {}, {}
    for variant in variants:
        cp = variant is BatchVariant.CP
        modes = supported_modes(runtime, variant)
        if not modes:
            what = (f"a {variant.value} batch" if variant in SCATTERED_VARIANTS else
                    f"moe_a2a_backend={runtime.moe_a2a_backend} with attention TP "
                    f"{runtime.parallel.dims.attn_tp}")
            raise UnsupportedBoundary(
                f"stage {name}: {what} keeps its residual scattered over "
                f"attention TP, and boundary_reduction={runtime.boundary_reduction} permits "
                "no reduce-scatter (use rs, rsv or rs+rsv)")
        for mode in modes:
            table = tables[(variant, mode)] = movement_table(runtime.parallel, mode, cp)
            paths[(variant, mode)] = _build_path(name, declaration, norm, following, runtime,
                                                 variant, mode, table, qkv_latent_func,
                                                 fusions)
    return StagePlan(name, declaration, paths, runtime, tables)


def _check_token_rows(name: str, declaration, variants) -> None:
    """Refuse a stage whose residual update needs each request's tokens in order
    (``token_rows``: a short convolution) where a batch gives a rank other rows than its DP
    rank's own: a CP or sequence-parallel batch (not built for it yet)."""
    update = declaration.residual.update
    if not needs_token_rows(update):
        return
    others = [v.value for v in variants if v is not BatchVariant.ORDINARY]
    if others:
        raise UnsupportedBoundary(f"stage {name}: {update!r} needs each request's tokens in "
                                  f"order, and the {', '.join(others)} batch variant is not "
                                  "built for it")


def _build_path(name, declaration, norm, following, runtime, variant, mode, table,
                qkv_latent_func, fusions) -> StagePath:
    """One (variant, mode) path of a stage."""
    prev = declaration.previous
    layouts = table.layouts
    output = resolve_output(declaration, following, runtime, layouts, fusions, mode, variant)
    stage_input = resolve_input(declaration, runtime, layouts, variant, mode)
    try:
        exit_path = bind_exit(output, mode, table, fusions=fusions, name=name,
                              declaration=declaration)
        if following is not None and following.parallel:
            # the FFN beside it joins this output to its own sum: never issued early
            default = exit_path.default
            joined = dataclasses.replace(default, label=f"{default.label}, joined to the "
                                                        "parallel FFN's")
            exit_path = dataclasses.replace(exit_path, default=joined, issues_early=False)
        if needs_token_rows(declaration.residual.update):
            # its consumer completes the sum onto each DP rank's token rows (a short
            # convolution): issued early, a two-batch-overlap microbatch's sum landed on the
            # residual's scattered rows under rs, which no entry takes
            exit_path = dataclasses.replace(exit_path, issues_early=False)
        prev_output = prev_exit = None
        if prev is not None:
            prev_output = resolve_output(prev, declaration, runtime, layouts, fusions,
                                         mode, variant)
            prev_exit = bind_exit(prev_output, mode, table, fusions=fusions,
                                  declaration=prev)
        residual = layouts.residual(mode)
        # an update that needs each request's tokens in order (a short convolution) runs on
        # this DP rank's own rows whatever the row mode: the producer's output is completed
        # onto them, and the residual stays there until a later entry moves it back
        update_rows = (layouts.local if prev is not None
                       and needs_token_rows(prev.residual.update) else residual)
        edge = EdgeDecl(prev_output, stage_input,
                        layouts.local if prev is None else residual, update_rows)
        entry = bind_entry(name, edge, prev_exit, declaration, norm, mode, table,
                           parallel=runtime.parallel, qkv_latent_func=qkv_latent_func,
                           fusions=fusions,
                           latent_first=variant is BatchVariant.INPUT_SCATTERED)
        branch_in = None
        if declaration.prepared_from is not None:
            source_rows = resolve_input(declaration.prepared_from, runtime, layouts,
                                        variant, mode).rows
            branch_in = table.lookup(None, source_rows, stage_input.rows)
    except UnsupportedBoundary as exc:
        raise UnsupportedBoundary(f"stage {name}: {exc}") from None
    return StagePath(StageDecl(variant, stage_input, output), edge, entry, exit_path, branch_in)
