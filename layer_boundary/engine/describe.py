"""What the plans of a built model say, as ``run`` and ``plan`` print them: one row per stage
(its prepare and exit paths, a branch's merge), and what crosses into a pipeline stage."""

from __future__ import annotations

from .. import stage_boundaries
from ..adapters.branch import describe_merge
from ..layout import RowMode


def plan_rows(model, mode: RowMode = RowMode.AR, variant=None) -> list[dict]:
    """One row per stage: what its prepare and exit do in row mode ``mode`` (in batch
    ``variant``; default: the one the plans serve first, ordinary or CP)."""
    boundaries = stage_boundaries(model)
    rows = []
    for i, boundary in enumerate(boundaries):
        rows.append(boundary.plan.describe(mode, variant))
        source = boundary.branch_source
        ends_branch = source is not None and (i + 1 == len(boundaries)
                                              or boundaries[i + 1].branch_source is not source)
        if ends_branch:  # the branch's way back into the stack
            # its owed sum is completed by branch_output(), not by the next input
            row = rows[-1]
            row["exit"] = row["exit"].replace("left to the next input", "left to branch_output")
            origin = next(b for b in boundaries if b.declaration is source)
            rows.append(describe_merge(origin, boundary, mode))
    return rows


def handoff_contract(receiver, mode: RowMode) -> str:
    """What crosses into pipeline stage ``receiver`` (a model), as its first boundary's own
    declaration rebuilds it in row mode ``mode``."""
    first = receiver.stack.first
    entry = first.plan.path(mode).entry
    text = (f"to_pp() completes per-batch work and applies the update; {first.name}.from_pp() "
            f"takes the residual on {entry.residual_src}")
    if entry.declared is not None:
        text += (f" and the partial output with its {entry.declared.owed.value} sum owed on "
                 f"{entry.declared.rows}")
    return text
