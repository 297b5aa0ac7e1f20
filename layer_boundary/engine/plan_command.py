"""``layer-boundary plan``: the per-stage boundary paths a batch shape takes, from construction
alone (models built on the meta device of a virtual topology; no ranks run, no weights load).

``explain_plan`` gathers the explanation into a ``PlanExplanation``; ``plan_json`` and
``log_plan_text`` are its two renderings (``--json`` and the table)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace

import torch

from ..adapters.tbo import TboPolicy, split_counts
from ..row_modes import select_mode
from ..contracts import BatchVariant
from ..layout import RowMode
from ..models import open_checkpoint
from ..models.tiny import builtin_checkpoint
from ..ops import row_facts, table_rows
from ..runtime.parallel import virtual_parallel
from .args import UsageError, engine_names, tp_dp
from .checks import check_pipeline, job_memory
from .describe import handoff_contract, plan_rows
from .features import check_spec
from .hub import model_folder
from .logs import setup_logging
from .report import PLAN_LEGEND, a2a_note, asked, model_line, model_record, plan_table
from .runner import RunSpec, forward_variants, runtime_of

log = logging.getLogger("layer_boundary.report")


@dataclass
class PlanExplanation:
    """What ``plan`` explains of one batch shape on one topology."""

    model_dir: str
    checkpoint: object  # the Checkpoint planned (its model_type and implementation)
    dims: object  # the ParallelDims the plan runs on
    variant: BatchVariant
    moe_a2a_backend: str
    policy: str  # the boundary-reduction policy resolved
    asked: str  # the policy as asked, for the header
    counts: tuple  # tokens per DP rank
    mode: RowMode
    reason: str  # why the row mode was chosen
    ranks: list  # each TP rank's rows
    stages: list  # each stage's paths (plan_rows), tagged with its pipeline stage under PP
    movements: list  # the movement table these paths come from
    memory: object  # the job's memory estimate
    pipeline: list | None  # each pipeline stage's ranks, layers and handoff (PP only)
    microbatches: list | None  # both two-batch-overlap microbatches' rows (--tbo only)

    @property
    def cp(self) -> bool:
        return self.dims.attn_cp > 1


def cmd_plan(args) -> int:
    """The per-stage path table for a batch shape, from construction alone (no ranks run)."""
    setup_logging(0, args.json)
    plan = explain_plan(args)
    if args.json:
        log.info(json.dumps(plan_json(plan)))
    else:
        log_plan_text(plan)
    return 0


# the most tokens a plan takes on one DP rank when the checkpoint names no position limit:
# the plan is one request of them, built as a list of ids
MAX_PLAN_TOKENS = 1 << 24


def explain_plan(args) -> PlanExplanation:
    """The explanation ``plan`` prints for its parsed ``args``: every check ``run`` makes of
    the same flags first, then each pipeline stage built on the meta device."""
    engine_names(args)
    args.tp, args.dp = tp_dp(args)
    model_dir = model_folder(args.model) or str(builtin_checkpoint())
    checkpoint = open_checkpoint(model_dir, args.model_impl)
    spec = _spec_of(args, model_dir, checkpoint)
    dims = spec.dims()  # names bad factors
    check_spec(spec)  # the combination table, as run asks it
    check_pipeline(args, checkpoint)
    policy = checkpoint.boundary_reduction(args.boundary_reduction)
    counts = args.tokens if args.tokens is not None else (4,) * args.dp
    if len(counts) != args.dp:
        raise UsageError(f"--tokens gives {len(counts)} DP token counts but --dp is {args.dp}")
    limit = checkpoint.raw.get("max_position_embeddings")
    limit = limit if isinstance(limit, int) and limit > 0 else MAX_PLAN_TOKENS
    if max(counts) > min(limit, MAX_PLAN_TOKENS):
        raise UsageError(f"--tokens {max(counts)} on one DP rank is more than the "
                         f"{min(limit, MAX_PLAN_TOKENS)} positions a request may have here (the "
                         "checkpoint's max_position_embeddings, at most "
                         f"{MAX_PLAN_TOKENS:,})")
    # memory for one request per DP rank of its --tokens, decoded for the run's default steps
    memory = job_memory(replace(spec, prompts=tuple((1,) * c for c in counts if c) or ((1,),)),
                        reference=False)
    cp = dims.attn_cp > 1
    variant = forward_variants(spec)[0]
    runtimes, models = _stage_models(spec, dims)
    runtime = runtimes[0]
    # a CP plan takes each DP rank's tokens as one request (the CP mapping cuts requests)
    lens = tuple((c,) if c else () for c in counts) if cp else None
    parts = row_facts(RowMode.AR, counts, runtime.parallel, lens).parts
    try:
        mode, reason = select_mode(runtime, counts, parts, cp, variant)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    stages = [dict(row, pp_stage=s) if dims.pp > 1 else row
              for s, m in enumerate(models) for row in plan_rows(m, mode, variant)]
    pipeline = _pipeline(models, dims, mode) if dims.pp > 1 else None
    ranks = _rows_per_rank(dims, mode, counts, lens)
    microbatches = _microbatches(runtime, dims, counts, lens) if args.tbo else None
    return PlanExplanation(
        model_dir=model_dir, checkpoint=checkpoint, dims=dims, variant=variant,
        moe_a2a_backend=args.moe_a2a_backend,
        policy=policy, asked=asked(args.boundary_reduction, checkpoint), counts=counts,
        mode=mode, reason=reason, ranks=ranks, stages=stages,
        movements=table_rows(runtime.parallel, mode, cp), memory=memory, pipeline=pipeline,
        microbatches=microbatches)


def _spec_of(args, model_dir: str, checkpoint) -> RunSpec:
    """The run spec ``run`` would build of the same topology and policy flags."""
    return RunSpec(model_dir, model_impl=args.model_impl, checkpoint=checkpoint, tp=args.tp,
                   dp=args.dp, ep=args.ep, cp=args.cp, pp=args.pp, pp_layers=args.pp_layers,
                   sequence_parallel=args.sequence_parallel,
                   attn_input_scattered=args.attn_input_scattered,
                   moe_a2a_backend=args.moe_a2a_backend,
                   tbo=TboPolicy.ALWAYS if args.tbo else TboPolicy.OFF,
                   boundary_reduction=args.boundary_reduction,
                   allreduce_fusion=not args.no_allreduce_fusion,
                   rs_padding=not args.no_rs_padding)


def _stage_models(spec, dims) -> tuple[list, list]:
    """Each pipeline stage's runtime and model, as the stage's first rank builds them."""
    checkpoint = spec.checkpoint
    runtimes, models = [], []
    for stage in range(dims.pp):
        runtimes.append(runtime_of(spec, virtual_parallel(dims, stage * dims.tp)))
        with torch.device("meta"):  # boundaries are built at construction; no weights needed
            models.append(checkpoint.model_class(checkpoint.config, runtimes[-1]))
    return runtimes, models


def _pipeline(models, dims, mode) -> list:
    return [{"stage": s, "ranks": [s * dims.tp, (s + 1) * dims.tp - 1],
             "layers": [m.stage.layers[0], m.stage.layers[-1]],
             "handoff": handoff_contract(models[s + 1], mode) if s + 1 < dims.pp else None}
            for s, m in enumerate(models)]


def _rows_per_rank(dims, mode, counts, lens) -> list:
    """Each TP rank's rows under ``mode`` (CP: its attention share too)."""
    cp = dims.attn_cp > 1
    out = []
    for rank in range(dims.tp):
        rows = row_facts(mode, counts, virtual_parallel(dims, rank), lens)
        out.append({"rank": rank, "dp_rank": rows.dp_rank, "local": rows.local,
                    **({"cp_rank": rows.parallel.attn_cp_rank, "attention": rows.share}
                       if cp else {}),
                    "scattered": rows.scattered, "global": rows.total})
    return out


def _microbatches(runtime, dims, counts, lens) -> list:
    """Both two-batch-overlap halves, each DP rank's tokens taken as one-token requests."""
    out = []
    for name, part in zip("AB", split_counts(tuple((1,) * c for c in counts))):
        part_mode, _ = select_mode(runtime, part)
        out.append({"microbatch": name, "tokens": list(part), "mode": part_mode.value,
                    "ranks": _rows_per_rank(dims, part_mode, part, lens)})
    return out


def plan_json(plan: PlanExplanation) -> dict:
    """``plan --json``'s object."""
    dims = plan.dims
    return {**model_record(plan.checkpoint),
            "tp": dims.tp, "dp": dims.attn_dp, "cp": dims.attn_cp, "attn_tp": dims.attn_tp,
            "variant": plan.variant.value, "moe_a2a_backend": plan.moe_a2a_backend,
            "boundary_reduction": plan.policy, "tokens": list(plan.counts),
            "mode": plan.mode.value, "reason": plan.reason, "ranks": plan.ranks,
            "stages": plan.stages, "movements": plan.movements,
            "memory": plan.memory.as_dict(),
            **({"pp": dims.pp, "pipeline": plan.pipeline} if plan.pipeline else {}),
            **({"microbatches": plan.microbatches} if plan.microbatches else {})}


def log_plan_text(plan: PlanExplanation) -> None:
    """``plan``'s table, to the report log."""
    _log_header(plan)
    _log_rows(plan)
    _log_stages(plan)
    for line in PLAN_LEGEND:
        log.info("%s", line)
    _log_movements(plan)


def _log_header(plan: PlanExplanation) -> None:
    dims, variant = plan.dims, plan.variant
    log.info("layer-boundary plan: %s  tp=%d dp=%d cp=%d attn_tp=%d  boundary_reduction=%s "
             "(asked %s)%s", plan.model_dir, dims.tp, dims.attn_dp, dims.attn_cp, dims.attn_tp,
             plan.policy, plan.asked, a2a_note(plan.moe_a2a_backend))
    log.info("%s", model_line(plan.checkpoint))
    article = "an" if variant.value[0] in "aeiou" else "a"
    log.info("memory (estimate): %s", plan.memory.describe())
    log.info("tokens per DP rank %s -> row mode %s (%s)%s", list(plan.counts), plan.mode.value,
             plan.reason,
             "" if variant is BatchVariant.ORDINARY else f", {article} {variant.value} batch")


def _log_rows(plan: PlanExplanation) -> None:
    """The rows each rank holds, for the batch and for each two-batch-overlap half."""
    if plan.cp:
        cp = plan.dims.attn_cp
        log.info("CP batch: each DP rank's tokens as one request, cut in %d chunks; CP rank r "
                 "attends chunks r and %d-r", 2 * cp, 2 * cp - 1)
        log.info("rows per rank (local / attention / scattered / global): %s", ", ".join(
            f"r{r['rank']} {r['local']}/{r['attention']}/{r['scattered']}/{r['global']}"
            for r in plan.ranks))
    else:
        log.info("rows per rank (local / scattered / global): %s", _rows_text(plan.ranks))
    for mb in plan.microbatches or ():
        log.info("two-batch overlap, microbatch %s: tokens per DP rank %s -> %s; rows %s",
                 mb["microbatch"], mb["tokens"], mb["mode"], _rows_text(mb["ranks"]))


def _rows_text(ranks) -> str:
    return ", ".join(f"r{r['rank']} {r['local']}/{r['scattered']}/{r['global']}"
                     for r in ranks)


def _log_stages(plan: PlanExplanation) -> None:
    """The path table: one for the model, or one a pipeline stage with its handoff."""
    if plan.pipeline is None:
        plan_table(plan.stages)
        return
    for p in plan.pipeline:
        log.info("pipeline stage %d (ranks %d-%d): layers %d-%d", p["stage"], *p["ranks"],
                 *p["layers"])
        plan_table([row for row in plan.stages if row["pp_stage"] == p["stage"]])
        if p["handoff"]:
            log.info("  -> stage %d: %s", p["stage"] + 1, p["handoff"])


def _log_movements(plan: PlanExplanation) -> None:
    log.info("\nthe movement table these paths come from (%s mode, this topology):",
             plan.mode.value)
    for m in plan.movements:
        owed = f"sum over {m['owed']}" if m["owed"] else "complete"
        log.info("  %-16s %-24s -> %-24s %-26s %s", owed, m["from"], m["to"], m["movement"],
                 m["contract"])
