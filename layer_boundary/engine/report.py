"""``run``'s report: the generated tokens, the parity verdict, each stage's boundary paths and
the collectives per forward (``--json``: one object). Only rank 0 reports, through logging."""

from __future__ import annotations

import json
import logging

from .verdict import (Outcome, Status, audit_line, audit_summary,  # noqa: F401 - re-exported
                      invariance_check, invariance_line, judge, overall_reason,
                      reads_quantized, verdict_line)

log = logging.getLogger("layer_boundary.report")


def asked(value: str, checkpoint) -> str:
    """The policy asked for, as the run and plan headers show it: ``auto`` with what chose
    its policy (the ``Checkpoint``'s ``architectures`` entry, ``model_type`` or
    ``text_config``)."""
    if value != "auto":
        return value
    return f"auto, by {checkpoint.auto_policy()[1]}"


# ``Checkpoint.impl`` in the text report's words
IMPL_WORDS = {"native": "native", "transformers": "transformers backend"}


def model_line(checkpoint, impl: str | None = None) -> str:
    """The report line naming the model and which implementation served it:
    ``model: qwen2 (transformers backend)`` or ``model: llama (native)``.

    Args:
        checkpoint: the ``Checkpoint`` (its ``model_type``).
        impl: the implementation that ran ("native" | "transformers"; None: the one
            ``checkpoint`` is opened for).
    """
    return f"model: {checkpoint.model_type} ({IMPL_WORDS[impl or checkpoint.impl]})"


def model_record(checkpoint, impl: str | None = None) -> dict:
    """``--json``'s keys naming the model: config.json's ``model_type`` and ``model_impl``
    ("native": our model file; "transformers": the Transformers backend), as ``model_line``."""
    return {"model_type": checkpoint.model_type, "model_impl": impl or checkpoint.impl}


def a2a_note(backend: str) -> str:
    return "" if backend == "none" else f"  MoE {backend} dispatch"


def _texts(args, spec, run) -> dict | None:
    """With ``--prompt``: each request's prompt and completion decoded by the checkpoint's
    tokenizer (request index -> (prompt text, completion text)); else None."""
    if not args.prompt:
        return None
    from .hub import tokenizer

    tok = tokenizer(spec.model_dir)
    return {i: (tok.decode(list(spec.prompts[i])), tok.decode(g))
            for i, g in zip(run.request_ids, run.generated)}



def tbo_summary(spec, rank0) -> dict | None:
    """Two-batch overlap's decisions on rank 0 (every rank decides alike): the policy, which
    forwards split, and why each did or did not (None: the overlap is off)."""
    from ..adapters.tbo import TboPolicy

    decisions = rank0.generation.tbo
    if spec.tbo is TboPolicy.OFF or not decisions:
        return None
    return {"policy": spec.tbo.value, "split": [d.split for d in decisions],
            "reasons": sorted({d.reason for d in decisions})}


def report(args, spec, results, reference, why_unchecked: str = "no reference run") -> int:
    """Log the run's report from every rank's result (``reference``: the world-1 run, or None
    when parity is not checked, ``why_unchecked`` saying why); the exit status: 1 where the
    verdict is FAIL (parity, batch invariance, the exactly-once audit or
    ``--require-fusions`` failed), else 0."""
    outcome = judge(spec, results, reference, why_unchecked,
                    require_fusions=getattr(args, "require_fusions", False))
    if args.logits_out:
        from safetensors.torch import save

        from . import logits_file

        run = outcome.run
        logits_file.write(args.logits_out, save({
            f"prompt{i}.step{j}": logit.float().contiguous()
            for i, steps in zip(run.request_ids, run.logits) for j, logit in enumerate(steps)}))
    if args.json:
        log.info(json.dumps(json_record(args, spec, results, outcome)))
    else:
        _text(args, spec, results, outcome)
        _collectives_text(spec, results[0])
        log.info("\n%s", verdict_line(outcome.checks))  # the report's last line, as documented
    required = outcome.check("required fusions")
    if required is not None and required.status is Status.FAIL:
        import sys

        print(f"layer-boundary: error: --require-fusions: {required.reason}", file=sys.stderr)
    return 1 if outcome.status is Status.FAIL else 0


def json_record(args, spec, results, outcome: Outcome) -> dict:
    """``run --json``'s object: what a script reads first (the verdict and why), then the
    run's facts."""
    from ..runtime.ledger import summarize
    from .runner import forward_variants, speculative_summary

    run, verdict, rank0 = outcome.run, outcome.verdict, results[0]
    texts = _texts(args, spec, run)
    speculative, tbo = speculative_summary(results), tbo_summary(spec, rank0)
    return {
        "verdict": outcome.status.value, "reason": overall_reason(outcome.checks),
        "checks": [c.record() for c in outcome.checks],
        **model_record(spec.checkpoint, rank0.model_impl),
        "tp": spec.tp, "dp": spec.dp, "ep": spec.ep, "pp": spec.pp,
        "boundary_reduction": rank0.resolved_reduction, "dtype": spec.dtype,
        "prompts": [{"prompt_ids": list(spec.prompts[i]), "generated_ids": g,
                     **({"prompt_text": texts[i][0], "generated_text": texts[i][1]}
                        if texts else {})}
                    for i, g in zip(run.request_ids, run.generated)],
        "parity": verdict, "collectives": summarize(rank0.ledger), "audit": outcome.audited,
        "stages": stage_rows(spec, results),
        **({"speculative": speculative} if speculative else {}),
        **({"tbo": tbo} if tbo else {}),
        **({"fusion_provider": spec.fusions, "fused_inputs": rank0.fused_inputs,
            "fused_final_norms": rank0.fused_final_norms,
            "fused_stages": rank0.fused_stages} if spec.fusions else {}),
        **({"cp": spec.cp} if spec.cp > 1 else {}),
        **({"moe_a2a_backend": spec.moe_a2a_backend}
           if spec.moe_a2a_backend != "none" else {}),
        **({"variants": [v.value for v in forward_variants(spec)]}
           if forward_variants(spec)[0].value != "ordinary" else {}),
        **({"compile": spec.compile, "compiled_graphs": rank0.compiled_graphs}
           if spec.compile else {}),
        **({"cuda_graphs": rank0.cuda_graphs} if spec.device == "cuda" else {}),
        **({"batch_invariance": outcome.invariance} if outcome.invariance is not None
           else {})}


def _text(args, spec, results, outcome: Outcome) -> None:
    """The text report up to the collectives: the header, each prompt, the modes that ran,
    the verdicts, each stage's paths."""
    from .runner import speculative_summary

    run, verdict, rank0 = outcome.run, outcome.verdict, results[0]
    texts, speculative = _texts(args, spec, run), speculative_summary(results)
    log.info("layer-boundary run: %s  %stp=%d dp=%d %sep=%d  boundary_reduction=%s (asked %s)  "
             "dtype=%s%s", spec.model_dir, f"pp={spec.pp} " if spec.pp > 1 else "", spec.tp,
             spec.dp, f"cp={spec.cp} " if spec.cp > 1 else "", spec.ep,
             rank0.resolved_reduction, asked(spec.boundary_reduction, spec.checkpoint),
             spec.dtype,
             ("  sequence-parallel prefill" if spec.sequence_parallel else
              "  input-scattered attention" if spec.attn_input_scattered else "")
             + a2a_note(spec.moe_a2a_backend) + _modes_on(spec)
             + (f"  compiled ({spec.compile}, fullgraph) into {rank0.compiled_graphs} "
                f"graph{'s' * (rank0.compiled_graphs != 1)} on rank 0" if spec.compile else ""))
    log.info("%s", model_line(spec.checkpoint, rank0.model_impl))
    if spec.device == "cuda":
        log.info("%s", graphs_line(rank0.cuda_graphs))
    for i, g in zip(run.request_ids, run.generated):
        adapter = f" (LoRA {spec.prompt_lora[i]})" if spec.prompt_lora else ""
        log.info("prompt %d %s%s -> generated %s", i, list(spec.prompts[i]), adapter, g)
        if texts:
            log.info("  text: %r -> %r", *texts[i])
    if speculative:
        log.info("speculative (%d draft steps): acceptance %.2f, %.2f tokens per target forward "
                 "per request, %d verification forwards, %d reruns", spec.speculative_steps,
                 speculative["acceptance_rate"], speculative["tokens_per_target_forward"],
                 speculative["target_forwards"], speculative["reruns"])
    tbo = tbo_summary(spec, rank0)
    if tbo:
        log.info("two-batch overlap (%s): %d of %d forwards split: %s", tbo["policy"],
                 sum(tbo["split"]), len(tbo["split"]), "; ".join(tbo["reasons"]))
    if spec.fusions:
        log.info("fusion provider %s on rank 0: %d inputs and %d final norms completed fused "
                 "(stages: %s)", spec.fusions, rank0.fused_inputs, rank0.fused_final_norms,
                 ", ".join(rank0.fused_stages) or "none")
        for row in stage_rows(spec, results):
            log.info("  %-16s %s", row["stage"], outcome_text(row["fusion"]))
    if outcome.invariance is not None:
        log.info("%s", invariance_line(outcome.invariance))
    log.info("%s", audit_line(outcome.audited))
    required = outcome.check("required fusions")
    if required is not None:
        log.info("required fusions: %s (%s)", required.status.value, required.reason)
    parity_check = outcome.check("parity")
    if verdict is None:
        log.info("parity: not checked (%s)", parity_check.reason)
    else:
        log.info("parity vs world 1: %s (tokens %s, max |logit diff| %.3g, %s)",
                 parity_check.status.value,
                 "match" if verdict["tokens_match"] else "DIFFER", verdict["max_abs_diff"],
                 outcome.how)
    log.info("\nboundary paths (per stage; row mode per forward: %s):",
             ", ".join(f"step {i} {m}" for i, m in enumerate(rank0.modes)))
    for head in (r for r in results if r.rank % spec.tp == 0):  # one rank per pipeline stage
        if spec.pp > 1:
            log.info("pipeline stage %d (ranks %d-%d): layers %d-%d", head.pp_rank, head.rank,
                     head.rank + spec.tp - 1, head.layers[0], head.layers[-1])
        plan_table(head.plan)
    for line in PATHS_LEGEND:
        log.info("%s", line)


def _collectives_text(spec, rank0) -> None:
    """Rank 0's collectives: per site for the prefill and the first decode step (later steps
    said to repeat it where they do), then over the run, logical and on gloo's wire."""
    from ..runtime.ledger import summarize

    if spec.compile:
        log.info("\ncollectives: not observed (a compiled forward runs no Python to report "
                 "from; run without --compile for the ledger)")
        return
    log.info("\ncollectives per forward on rank 0 (count x kind, bytes; step 0 = prefill):")
    lines = {}  # step -> its per-site lines
    for step in sorted({e.step for e in rank0.ledger}):
        per_site: dict[str, list] = {}
        for e in rank0.ledger:
            if e.step == step:
                per_site.setdefault(e.site, []).append(e)
        lines[step] = [f"    {site:<22} " + ", ".join(
            f"{v['count']}x {k} {v['bytes']} B" for k, v in summarize(entries).items())
            for site, entries in per_site.items()]
    steps = sorted(lines)
    for step in steps[:2]:
        log.info("  step %d:", step)
        for line in lines[step]:
            log.info("%s", line)
    if len(steps) > 2:  # decode steps past the first: say whether they repeat it
        same = [s for s in steps[2:] if lines[s] == lines[steps[1]]]
        other = [s for s in steps[2:] if s not in same]
        if same:
            log.info("  step%s %s repeat%s step %d", "s" * (len(same) > 1), _span(same),
                     "" if len(same) > 1 else "s", steps[1])
        for step in other:
            log.info("  step %d:", step)
            for line in lines[step]:
                log.info("%s", line)
    collectives = summarize(rank0.ledger)
    log.info("\ncollectives over the run: %s", ", ".join(
        f"{k}: {v['count']} ({v['bytes']} B)" for k, v in collectives.items()) or "none")
    if rank0.ledger:  # the figures above are the logical (ring) bytes
        from ..runtime.ledger import wire_total

        log.info("on gloo's wire (a reduce-scatter is an exchange of blocks, or gloo's own "
                 "all-reduce when asynchronous or compiled; a variable gather is padded to the "
                 "widest rank; a small sum is a gather): %d B, against %d B logical",
                 wire_total(rank0.ledger), sum(e.bytes for e in rank0.ledger))


def stage_rows(spec, results) -> list[dict]:
    """Each stage of the model, in order: the path it ran (prepare and exit, in the first
    forward's row mode) and, with a fusion provider, its candidates' outcome on that stage's
    first rank (``ReferenceFusions.outcomes``)."""
    rows = []
    for head in (r for r in results if r.rank % spec.tp == 0):  # one rank a pipeline stage
        for row in head.plan:
            entry = {k: row[k] for k in ("stage", "mixer", "entry", "exit") if k in row}
            if spec.fusions:
                entry["fusion"] = head.fusion_outcomes.get(
                    row["stage"], {"offered": 0, "applied": 0, "declined": {}})
            rows.append(entry)
    return rows


def outcome_text(outcome: dict) -> str:
    """One stage's fusion outcome in words."""
    if not outcome["offered"]:
        return "nothing offered" + (f": {outcome['not_offered']}" if "not_offered" in outcome
                                    else "")
    words = [f"applied {outcome['applied']}x"]
    words += [f"declined {n}x: {why}" for why, n in outcome["declined"].items()]
    if not outcome["applied"] and not outcome["declined"]:
        words = ["offered, never asked (nothing arrived to complete)"]
    return "; ".join(words)


def graphs_line(graphs: dict) -> str:
    """The report's line on CUDA graphs (``RankResult.cuda_graphs``, rank 0's)."""
    if graphs["mode"] == "off":
        return f"CUDA graphs: off: {graphs['why']}"
    line = f"CUDA graphs: {graphs['mode']}: {graphs['why']}"
    if "step" in graphs:
        line += f"; each graph holds the {graphs['step']} decode step"
    if "buckets" in graphs:
        line += (f"; {len(graphs['buckets'])} captured (token buckets "
                 f"{', '.join(map(str, graphs['buckets'])) or 'none'}), "
                 f"{graphs['replays']} replays after their capture")
    if graphs.get("skipped"):
        line += "; inductor skipped: " + "; ".join(sorted(set(graphs["skipped"])))
    elif "skipped" in graphs:
        line += "; inductor skipped none"
    return line


def _modes_on(spec) -> str:
    """The header's words for the run's other modes that are on."""
    from ..adapters.tbo import TboPolicy

    words = []
    if spec.tbo is not TboPolicy.OFF:
        words.append(f"two-batch overlap ({spec.tbo.value})")
    if spec.split_prefill > 1:
        words.append(f"prefill in {spec.split_prefill} segments")
    if spec.speculative:
        source = ("its NextN layer" if spec.speculative_algorithm == "nextn"
                  else f"draft {spec.draft_model}")
        words.append(f"speculative ({source}, {spec.speculative_steps} steps)")
    if spec.lora:
        words.append(f"LoRA {', '.join(name for name, _ in spec.lora)}")
    if spec.fusions:
        words.append(f"fusion provider {spec.fusions}")
    return "".join(f"  {w}" for w in words)


def _span(steps: list[int]) -> str:
    """``2-3`` for consecutive steps, else ``2, 4``."""
    if steps == list(range(steps[0], steps[-1] + 1)) and len(steps) > 1:
        return f"{steps[0]}-{steps[-1]}"
    return ", ".join(map(str, steps))


# the notation of a paths table (run prints it after its table)
PATHS_LEGEND = (
    "legend:",
    "  replicated: every DP rank's rows on every rank; attn_dp: this DP rank's rows; "
    "attn_tp_scatter: a slice of them per attention-TP rank",
    "  partial: attn_tp sum owed: compute left its sum over attention TP to the next prepare; "
    "X sum left to the next input (or the final norm): the same, by the exit's decision",
    "  all_reduce(g) / reduce_scatter(g) / all_gather(g): one collective over group g; _v: "
    "variable rows per rank; -> : the steps in order",
)
# plan's table also gives the rows per rank
PLAN_LEGEND = (PATHS_LEGEND[0],
               "  rows per rank a/b/c: this rank's local rows (its DP rank's tokens) / its "
               "scattered slice of them / every DP rank's rows (CP: local / share / scattered "
               "/ global)", *PATHS_LEGEND[1:])


def plan_table(rows) -> None:
    labels = [r["stage"] + (f" ({r['mixer']})" if "mixer" in r else "") for r in rows]
    names = max(map(len, labels))
    width = max(len(r["entry"]) for r in rows)
    log.info("  %-*s %-*s  %s", names, "stage", width, "prepare", "exit")
    for label, row in zip(labels, rows):
        log.info("  %-*s %-*s  %s", names, label, width, row["entry"], row["exit"])

