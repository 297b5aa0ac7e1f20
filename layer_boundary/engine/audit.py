"""The exactly-once audit of a rank's forwards: every declared contribution summed once, over
the group its declaration names.

The failure it is aimed at is the one engines ship: a sum done twice (an MoE that all-reduces
in its own compute while the attention-DP step reduce-scatters the same output over the same
group: sglang#37187, GPT-OSS at 0/128 on GSM8K) or not at all. Parity against world 1 shows
such a bug as wrong numbers; the audit names the stage and the sum.

Each sum the ledger recorded in a forward (an all-reduce or a reduce-scatter, whatever the
backend ran underneath) is matched to the contribution it completes by its site: a sum in a
stage's compute or finish completes that stage's own output; a sum in a stage's prepare
completes what arrived there, the output of the stage before it; the final norm's completes
the last stage's. A stage's declaration (``StageOutput`` of the path the forward took) names
its sum: the group it owes (``sum_group``), or the group its sequence-parallel linears
reduce-scatter over (``linears_sum``). Exactly once means: one sum, over that group, where
this rank holds rows of the output; none where the group is a single rank, the output is
complete (an all-to-all MoE combines it), or this rank's share is empty (its group skips the
collective together). Sums outside a stage's sites (the embedding's, a norm's statistics)
are not contributions and are left out.

Not audited (the report says so): compiled forwards (no ledger), two-batch overlap (each
microbatch sums its own rows), speculative decoding (several forwards a step), and what
crosses a pipeline boundary (the last output of a pipeline stage, completed on the next).
"""

from __future__ import annotations

from collections import defaultdict

from .. import stage_boundaries
from ..layout import sum_group

SUMS = ("all_reduce", "reduce_scatter")


def not_audited(spec) -> str | None:
    """Why ``spec``'s forwards are not audited, or None."""
    reasons = ((spec.compile is not None, "a compiled forward records no ledger"),
               (spec.tbo.value != "off", "two-batch overlap's microbatches sum their own rows"),
               (spec.speculative, "speculative decoding runs several forwards a step"))
    return next((why for skip, why in reasons if skip), None)


def expected_sum(stage, forward, parallel) -> tuple[str | None, int]:
    """(the group name a stage's output is summed over, how many sums this rank runs for it
    in ``forward``: 0 or 1)."""
    variant, mode, facts = forward
    path = stage.plan.paths.get((variant, mode))
    if path is None:
        return None, 0
    out = path.decl.output
    which = out.linears_sum if out.linears_sum is not None else out.sum_group
    if which is None:
        return None, 0
    group = sum_group(parallel, which)
    rows = out.linears_rows if out.linears_sum is not None else out.rows
    if group.size == 1 or facts.count(rows) == 0:
        return group.name, 0
    return group.name, 1


def owners(stages) -> dict[str, str]:
    """Ledger site -> the stage whose output a sum there completes."""
    out = {}
    for i, stage in enumerate(stages):
        out[f"{stage.name}.compute"] = out[f"{stage.name}.finish"] = stage.name
        if i > 0:
            out[f"{stage.name}.prepare"] = stages[i - 1].name
    if stages:
        out["final_norm"] = out["final_norm.fused"] = stages[-1].name
    return out


def audit(model, parallel, entries, forwards) -> list[str]:
    """Each violation of exactly-once summing in this rank's forwards, in words (empty: none).

    Args:
        model: the rank's model (its stages, in stack order).
        parallel: its topology.
        entries: the ledger of the run (``LedgerEntry``, each with its forward's ``step``).
        forwards: per step, (batch variant, row mode, row facts) of the forward.
    """
    stages = list(stage_boundaries(model))
    site_owner = owners(stages)
    sends = not model.stage.last  # its last output crosses to the next pipeline stage
    if sends:
        site_owner.pop("final_norm", None)
    sums = defaultdict(list)  # (step, stage) -> its sums
    for e in entries:
        owner = site_owner.get(e.site)
        if e.kind in SUMS and owner is not None:
            sums[(e.step, owner)].append(e)
    violations = []
    for step, forward in enumerate(forwards):
        for stage in stages[:-1] if sends else stages:
            group, want = expected_sum(stage, forward, parallel)
            got = sums[(step, stage.name)]
            ran = ", ".join(f"{e.kind} over {e.group} at {e.site}" for e in got) or "none"
            if len(got) != want:
                violations.append(
                    f"step {step}: {stage.name}'s output summed {len(got)} times, declared "
                    f"{want} ({'over ' + group if group else 'complete'}): {ran}")
            elif got and got[0].group != group:
                violations.append(f"step {step}: {stage.name}'s output summed over "
                                  f"{got[0].group}, declared over {group}: {ran}")
    return violations
