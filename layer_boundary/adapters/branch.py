"""Prepared branches: stages that run from an input another stage already prepared.

LongCat-Flash reads one normalised input twice: its MoE's, and a branch of a dense FFN, an
attention and another dense FFN built with ``prepared_from=moe_boundary.declaration``. The
branch forks the residual stream at the source's residual (the source's own output stays
pending on the main stream), runs its stages on its own stream, and merges back:

    h = moe_boundary.prepare(h, forward_batch)
    with moe_boundary.exit(forward_batch) as out:
        moe = moe_compute(h)
    moe = out.finish(moe)
    x = branch_input(moe_boundary, h, forward_batch)   # the prepared input, on the branch's rows
    with ffn0.exit(forward_batch) as out:                # the entry stage never prepares
        y = ffn0_compute(x)
    y = out.finish(y)
    ...                                                  # attention, FFN: prepare/exit as usual
    y = branch_output(y, forward_batch)                  # complete, on local rows
    h = merge_branch(moe, y, forward_batch)              # one stream again

The input moves, and the branch output completes, with movements from the table
(ops.TRANSITIONS). The merge keeps the source's sum owed: the branch's complete output joins
the source's partial on one attention-TP rank (a plain add may move before a sum), so the
next input completes both with the source's one collective.
"""

from __future__ import annotations

from ..exit import StageExit
from ..residual import is_plain
from ..residual.access import complete_onto, local_rows
from ..residual.stream import Turn, stream_of
from ..runtime.ledger import active_observer
from ..stage import StageBoundary

NOT_FORKED = "{call} outside a branch: enter one with branch_input()"


def branch_input(source: StageBoundary, hidden_states, forward_batch):
    """Fork the stream at ``source``'s residual and hand its prepared input, moved onto the
    branch entry stage's compute rows, to that stage (whose ``exit()`` runs next).

    Args:
        source: the stage the branch is prepared from, after its ``finish()``.
        hidden_states: the input ``source.prepare()`` returned.
        forward_batch: the forward.
    """
    stream = stream_of(forward_batch)
    entry = source.branch
    if entry is None:
        raise RuntimeError(f"no branch was built with prepared_from={source.name}'s declaration "
                           "on its layer stack (or with prepared_from=the stage itself)")
    if stream.stage is not source or stream.prepared_input is not hidden_states:
        raise RuntimeError(f"branch_input takes the input stage {source.name} prepared in this "
                           "forward")
    if isinstance(stream.handle, (Turn, StageExit)):
        raise RuntimeError(f"branch_input: stage {source.name} has not published its output; "
                           "fork after its finish()")
    if stream.contribution is None:
        raise RuntimeError(f"branch_input: stage {source.name} left no pending output to merge "
                           "the branch into")
    path, facts = entry.plan.select(forward_batch)
    observer = active_observer()
    if observer is not None:  # the input's movement is the entry stage's, not the source's
        observer.enter(entry.sites.prepare)
    x = path.branch_in.move(facts, hidden_states) if path.branch_in.moves else hidden_states
    # the entry's turn: its exit() selects its step
    forward_batch.boundary.stream = stream.fork(entry, x)
    return x


def branch_output(hidden_states, forward_batch):
    """The branch's last output, complete, on local rows (the handle to merge).

    Args:
        hidden_states: what the branch's last stage returned.
        forward_batch: the forward (on the branch's stream).
    """
    stream = stream_of(forward_batch)
    if stream.parent is None:
        raise RuntimeError(NOT_FORKED.format(call="branch_output()"))
    stream.check(hidden_states)
    if stream.contribution is None:
        raise RuntimeError("branch_output() needs the branch's last output; nothing is pending")
    _enter(stream, "branch_output")
    facts = forward_batch.row_facts
    stream.close_branch(complete_onto(stream, facts, local_rows(facts)).value)
    return stream.branch_output


def merge_branch(source_output, branch_output_, forward_batch):
    """One stream again: the branch's residual, and the source's pending output with the
    branch's complete output added in once (plain updates only).

    Args:
        source_output: what the source stage's exit returned.
        branch_output_: what ``branch_output()`` returned.
        forward_batch: the forward.

    Returns what the model passes on.
    """
    branch = stream_of(forward_batch)
    main = branch.parent
    if main is None:
        raise RuntimeError(NOT_FORKED.format(call="merge_branch()"))
    branch.check(branch_output_)
    main.check(source_output)
    b, s = branch.contribution, main.contribution
    if branch_output_ is not branch.branch_output:
        raise RuntimeError("merge_branch() takes the branch's output from branch_output()")
    if not (is_plain(b.update) and is_plain(s.update)):
        raise RuntimeError("merge_branch() requires plain residual updates")
    _enter(branch, "merge")
    facts = forward_batch.row_facts
    value = s.value.complete() if s.handoff else s.value
    if s.owed is None:
        value = value + facts.movement(None, b.rows, s.rows).move(facts, b.value)
    else:  # one rank adds it before the sum the source still owes
        value = facts.add_on_one_rank(value, s.rows, b.value)
    main.rejoin(branch)
    forward_batch.boundary.stream = main
    return main.leave(value, s.owed, s.update, s.rows, declared=s.declared)


def _enter(stream, phase: str) -> None:
    observer = active_observer()
    if observer is not None and stream.stage is not None:
        observer.enter(f"{stream.stage.name}.{phase}")


def describe_merge(source: StageBoundary, last: StageBoundary, mode) -> dict:
    """A plan row for a branch's way back: its last output completed onto local rows, then
    merged into the source's pending output."""
    from ..contracts import BatchVariant

    variant = BatchVariant.ORDINARY
    decision = last.plan.paths[(variant, mode)].exit.default
    owed, facts = ((None, decision.finish_move.dst) if decision.finish_move is not None
                  else (decision.owed, decision.rows))
    table = last.plan.tables[(variant, mode)]
    local = table.layouts.local
    move = table.lookup(owed, facts, local)
    source_owes = source.plan.paths[(variant, mode)].exit.default.owed
    joins = (f"added on one attention-TP rank to {source.name}'s output, before its "
             f"{source_owes.value} sum" if source_owes is not None
             else f"added to {source.name}'s output")
    return {"stage": f"{last.name}.merge", "kind": "merge",
            "entry": f"branch_output: {move.name} onto {local}; merge_branch: {joins}",
            "exit": "-"}
