"""``layer-boundary plan``: the per-stage boundary paths a batch shape takes, from construction
alone (models built on the meta device of a virtual topology; no ranks run, no weights load)."""

from __future__ import annotations

import json
import logging

from ..adapters.tbo import TboPolicy
from .args import UsageError, engine_names, model_folder, tp_dp
from .checks import check_pipeline
from .logs import setup_logging
from .report import PLAN_LEGEND, a2a_note, asked, plan_table

log = logging.getLogger("layer_boundary.report")


def cmd_plan(args) -> int:
    """The per-stage path table for a batch shape, from construction alone (no ranks run)."""
    from dataclasses import replace

    import torch

    from ..construction import select_mode
    from ..contracts import BatchVariant
    from ..layout import RowMode
    from ..models import open_checkpoint
    from ..models.tiny import builtin_checkpoint
    from ..ops import row_facts, table_rows
    from ..runtime.parallel import virtual_parallel
    from .checks import job_memory
    from .describe import handoff_contract, plan_rows
    from .features import check_spec
    from .runner import RunSpec, forward_variants, runtime_of

    setup_logging(0)
    engine_names(args)
    args.tp, args.dp = tp_dp(args)
    model_dir = model_folder(args.model) or str(builtin_checkpoint())
    checkpoint = open_checkpoint(model_dir)
    cfg, model_cls = checkpoint.config, checkpoint.model_class
    spec = RunSpec(model_dir, checkpoint=checkpoint, tp=args.tp, dp=args.dp, ep=args.ep,
                   cp=args.cp, pp=args.pp, pp_layers=args.pp_layers,
                   sequence_parallel=args.sequence_parallel,
                   attn_input_scattered=args.attn_input_scattered,
                   moe_a2a_backend=args.moe_a2a_backend,
                   tbo=TboPolicy.ALWAYS if args.tbo else TboPolicy.OFF,
                   boundary_reduction=args.boundary_reduction,
                   allreduce_fusion=not args.no_allreduce_fusion,
                   rs_padding=not args.no_rs_padding)
    dims = spec.dims()  # names bad factors
    check_spec(spec)  # the combination table, as run asks it
    check_pipeline(args, checkpoint)
    policy = checkpoint.boundary_reduction(args.boundary_reduction)
    counts = args.tokens if args.tokens is not None else (4,) * args.dp
    if len(counts) != args.dp:
        raise UsageError(f"--tokens gives {len(counts)} DP token counts but --dp is {args.dp}")
    # memory for one request per DP rank of its --tokens, decoded for the run's default steps
    memory = job_memory(replace(spec, prompts=tuple((1,) * c for c in counts if c) or ((1,),)),
                        reference=False)
    cp = dims.attn_cp > 1
    variant = forward_variants(spec)[0]
    runtimes, models = [], []
    for stage in range(dims.pp):  # each pipeline stage as its first rank builds it
        runtimes.append(runtime_of(spec, virtual_parallel(dims, stage * dims.tp)))
        with torch.device("meta"):  # boundaries are built at construction; no weights needed
            models.append(model_cls(cfg, runtimes[-1]))
    runtime = runtimes[0]
    # a CP plan takes each DP rank's tokens as one request (the CP mapping cuts requests)
    lens = tuple((c,) if c else () for c in counts) if cp else None
    parts = row_facts(RowMode.AR, counts, runtime.parallel, lens).parts
    try:
        mode, reason = select_mode(runtime, counts, parts, cp, variant)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    table = [dict(row, pp_stage=s) if dims.pp > 1 else row
             for s, m in enumerate(models) for row in plan_rows(m, mode, variant)]
    pipeline = [{"stage": s, "ranks": [s * dims.tp, (s + 1) * dims.tp - 1],
                 "layers": [m.stage.layers[0], m.stage.layers[-1]],
                 "handoff": handoff_contract(models[s + 1], mode) if s + 1 < dims.pp else None}
                for s, m in enumerate(models)] if dims.pp > 1 else None
    def rows_per_rank(mode, counts):
        out = []
        for rank in range(dims.tp):
            rows = row_facts(mode, counts, virtual_parallel(dims, rank), lens)
            out.append({"rank": rank, "dp_rank": rows.dp_rank, "local": rows.local,
                        **({"cp_rank": rows.parallel.attn_cp_rank, "attention": rows.share}
                           if cp else {}),
                        "scattered": rows.scattered, "global": rows.total})
        return out

    per_rank = rows_per_rank(mode, counts)
    microbatches = None
    if args.tbo:
        from ..adapters.tbo import split_counts

        microbatches = []
        for name, part in zip("AB", split_counts(tuple((1,) * c for c in counts))):
            part_mode, _ = select_mode(runtime, part)
            microbatches.append({"microbatch": name, "tokens": list(part),
                                 "mode": part_mode.value,
                                 "ranks": rows_per_rank(part_mode, part)})
    movements = table_rows(runtime.parallel, mode, cp)
    if args.json:
        log.info(json.dumps({"tp": dims.tp, "dp": dims.attn_dp, "cp": dims.attn_cp,
                             "attn_tp": dims.attn_tp, "variant": variant.value,
                             "moe_a2a_backend": args.moe_a2a_backend,
                             "boundary_reduction": policy, "tokens": list(counts),
                             "mode": mode.value, "reason": reason, "ranks": per_rank,
                             "stages": table, "movements": movements,
                             "memory": memory.as_dict(),
                             **({"pp": dims.pp, "pipeline": pipeline} if pipeline else {}),
                             **({"microbatches": microbatches} if microbatches else {})}))
        return 0
    log.info("layer-boundary plan: %s  tp=%d dp=%d cp=%d attn_tp=%d  boundary_reduction=%s "
             "(asked %s)%s", model_dir, dims.tp, dims.attn_dp, dims.attn_cp, dims.attn_tp, policy,
             asked(args.boundary_reduction, checkpoint), a2a_note(args.moe_a2a_backend))
    article = "an" if variant.value[0] in "aeiou" else "a"
    log.info("memory (estimate): %s", memory.describe())
    log.info("tokens per DP rank %s -> row mode %s (%s)%s", list(counts), mode.value, reason,
             "" if variant is BatchVariant.ORDINARY else f", {article} {variant.value} batch")
    if cp:
        log.info("CP batch: each DP rank's tokens as one request, cut in %d chunks; CP rank r "
                 "attends chunks r and %d-r", 2 * dims.attn_cp, 2 * dims.attn_cp - 1)
        log.info("rows per rank (local / attention / scattered / global): %s", ", ".join(
            f"r{r['rank']} {r['local']}/{r['attention']}/{r['scattered']}/{r['global']}"
            for r in per_rank))
    else:
        log.info("rows per rank (local / scattered / global): %s", ", ".join(
            f"r{r['rank']} {r['local']}/{r['scattered']}/{r['global']}" for r in per_rank))
    for mb in microbatches or ():
        log.info("two-batch overlap, microbatch %s: tokens per DP rank %s -> %s; rows %s",
                 mb["microbatch"], mb["tokens"], mb["mode"], ", ".join(
                     f"r{r['rank']} {r['local']}/{r['scattered']}/{r['global']}"
                     for r in mb["ranks"]))
    if pipeline is None:
        plan_table(table)
    for p in pipeline or ():
        log.info("pipeline stage %d (ranks %d-%d): layers %d-%d", p["stage"], *p["ranks"],
                 *p["layers"])
        plan_table([row for row in table if row["pp_stage"] == p["stage"]])
        if p["handoff"]:
            log.info("  -> stage %d: %s", p["stage"] + 1, p["handoff"])
    for line in PLAN_LEGEND:
        log.info("%s", line)
    log.info("\nthe movement table these paths come from (%s mode, this topology):", mode.value)
    for m in movements:
        owed = f"sum over {m['owed']}" if m["owed"] else "complete"
        log.info("  %-16s %-24s -> %-24s %-26s %s", owed, m["from"], m["to"], m["movement"],
                 m["contract"])
    return 0

