"""The exactly-once audit of a rank's forwards: every declared contribution summed once, over
the group its declaration names.

The failure it is aimed at is the one engines ship: a sum done twice (an MoE that all-reduces
in its own compute while the attention-DP step reduce-scatters the same output over the same
group: sglang#37187, GPT-OSS at 0/128 on GSM8K) or not at all. Parity against world 1 shows
such a bug as wrong numbers; the audit names the stage and the sum.

Each sum the ledger recorded in a forward (an all-reduce or a reduce-scatter, whatever the
backend ran underneath) is matched to the contribution it completes by its site: a sum in a
stage's compute, finish or branch output completes that stage's own output; a sum in a
stage's prepare completes what arrived there, the output of the stage before it on its line
(the main line, or its branch); the final norm's completes the main line's last. A stage's
declaration (``StageOutput`` of the path the forward took) names its sum: the group it owes
(``sum_group``), or the group its sequence-parallel linears reduce-scatter over
(``linears_sum``). Exactly once means: one sum, over that group (or over the TP group on
every DP rank's rows, where the others add zeros), where this rank holds rows of the output;
none where the group is a single rank or the output is complete (an all-to-all MoE combines
it); at most one where this rank's share is empty (its group skips the collective together,
or runs it on padding). Sums outside a stage's sites (the embedding's, a norm's statistics)
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
# set to 1 (the tests do), a rank whose audit finds a violation raises ``AuditError`` at the
# end of its run, so no multi-rank test passes on numbers that a double sum happened to keep
STRICT_ENV = "LAYER_BOUNDARY_STRICT_AUDIT"


class AuditError(RuntimeError):
    """A rank's forwards summed a declared contribution other than exactly once."""


def not_audited(spec) -> str | None:
    """Why ``spec``'s forwards are not audited, or None."""
    reasons = ((spec.compile is not None, "a compiled forward records no ledger"),
               (spec.tbo.value != "off", "two-batch overlap's microbatches sum their own rows"),
               (spec.speculative, "speculative decoding runs several forwards a step"))
    return next((why for skip, why in reasons if skip), None)


def expected_sum(stage, forward, parallel) -> tuple[object, range]:
    """(the group a stage's output is summed over, or None; how many sums this rank may run
    for it in ``forward``)."""
    variant, mode, facts = forward
    path = stage.plan.paths.get((variant, mode))
    if path is None or getattr(stage.following, "parallel", False):
        # a parallel block's attention: its partial joins the FFN's sum, audited there
        return None, range(0, 1)
    out = path.decl.output
    which = out.linears_sum if out.linears_sum is not None else out.sum_group
    if which is None:
        return None, range(0, 1)
    group = sum_group(parallel, which)
    if group.size == 1:
        return group, range(0, 1)
    rows = out.linears_rows if out.linears_sum is not None else out.rows
    # a share with no rows: the group may skip the sum together (no rank has rows) or run it
    # on padding (a fixed-size reduce-scatter): once at most
    return group, range(0, 2) if facts.count(rows) == 0 else range(1, 2)


def _declared(entry, group, parallel, facts, width: int) -> bool:
    """Whether the sum ``entry`` is over ``group``: its ranks (attention TP is the TP group
    where there is no attention DP or CP), or a group holding them whose other ranks add
    zeros, on every DP rank's rows (``ar`` under attention DP sums an attention's partial
    over the TP group on the global rows: its attention-TP sum and the DP gather at once)."""
    other = getattr(parallel, f"{entry.group}_group", None)
    if other is None:
        return False
    if other.ranks == group.ranks:
        return True
    return (set(group.ranks) < set(other.ranks)
            and entry.numel == facts.count(facts.layouts.replicated) * width)


def owners(stages) -> dict[str, str]:
    """Ledger site -> the stage whose output a sum there completes. A stage's prepare
    completes the output of the stage before it on its own line: the main line, or the
    branch it belongs to (a branch's stages share the declaration it is prepared from; its
    last output is completed at its ``branch_output``, or joins a main-line output's sum)."""
    lines: dict = {}
    for stage in stages:
        source = stage.branch_source
        lines.setdefault(None if source is None else id(source), []).append(stage)
    out = {}
    for line in lines.values():
        for i, stage in enumerate(line):
            for call in ("compute", "finish", "branch_output"):
                out[f"{stage.name}.{call}"] = stage.name
            if i > 0:
                out[f"{stage.name}.prepare"] = line[i - 1].name
    main = lines.get(None)
    if main:
        out["final_norm"] = out["final_norm.fused"] = main[-1].name
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
    width = model.config.hidden_size
    site_owner = owners(stages)
    # a pipeline stage that sends: its main line's last output crosses to the next stage
    crosses = None if model.stage.last else model.stack.last.name
    sums = defaultdict(list)  # (step, stage) -> its sums
    for e in entries:
        owner = site_owner.get(e.site)
        if e.kind in SUMS and owner is not None:
            sums[(e.step, owner)].append(e)
    violations = []
    for step, forward in enumerate(forwards):
        for stage in stages:
            if stage.name == crosses:
                continue
            group, want = expected_sum(stage, forward, parallel)
            got = sums[(step, stage.name)]
            ran = ", ".join(f"{e.kind} over {e.group} at {e.site}" for e in got) or "none"
            declared = f"over {group.name}" if group is not None else "complete"
            if len(got) not in want:
                times = "once" if want == range(1, 2) else "at most once"
                violations.append(f"step {step}: {stage.name}'s output summed {len(got)} "
                                  f"times, declared {times} ({declared}): {ran}")
            elif got and (group is None or not _declared(got[0], group, parallel, forward[2],
                                                         width)):
                violations.append(f"step {step}: {stage.name}'s output summed over "
                                  f"{got[0].group}, declared {declared}: {ran}")
    return violations
