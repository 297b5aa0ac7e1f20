"""Parallel blocks: attention and FFN read one residual, and one collective sums both.

Cohere's block is ``x + attn(ln(x)) + mlp(ln(x))``; GPT-NeoX's (``use_parallel_residual``)
reads ``x`` with two norms. Declared as two stages, a PARTIAL attention then an FFN with
``declare_ffn(parallel=True)``, the model's forward is the ordinary one (``prepare``/``exit``
or ``run`` for each stage), and the boundaries do this:

- the attention publishes its partial as usual; its sum is not completed;
- the FFN's prepare sets that partial aside (``ResidualStream.set_aside``) and reads the
  residual the attention read, with the FFN's own norm, moved onto the FFN's compute rows;
- the FFN's exit always leaves its own sum owed (an all-reduce under ``ar``, a reduce-scatter
  under ``rs``/``rsv``), and its finish adds the attention's partial into that owed partial
  (``join``), so the next input completes both in one collective.

Where the attention's partial lands in the FFN's: without attention DP both sit on the same
rows and owe a sum over the same ranks (attention TP is TP), so they add. Under attention DP
the FFN computes on every DP rank's rows with its full-TP shard; each rank adds its attention
partial into its own DP rank's (or, in a CP batch, its CP share's) rows of the FFN partial,
and the sum over TP then holds each token's attention output once: the attention-TP ranks of
a DP rank add its pieces, every other rank adds zeros there. An attention output already
complete (attention TP 1, or completed by an accessor) is added on one attention-TP rank.

What it refuses, at construction (``check``): a producer other than a PARTIAL attention, a
residual update other than the plain add on either stage (the partials are summed before any
update applies), and the sequence-parallel batch (its attention completes on scattered rows).
"""

from __future__ import annotations

import torch

from .contracts import BatchVariant, ProducerReduction, StageKind, UnsupportedBoundary
from .residual import is_plain
from .residual.add_norm import accumulate_dtype

NOTHING_TO_JOIN = ("stage {stage} is a parallel block's FFN: it joins the output of the "
                   "attention before it to its own sum, and that attention has published "
                   "nothing (call its finish() or exit() first)")


def check(name: str, declaration, variants) -> None:
    """Refuse, by name, a parallel FFN this package cannot join with its producer."""
    prev = declaration.previous
    if prev is None or prev.kind is not StageKind.ATTN or (
            prev.reduction is not ProducerReduction.PARTIAL):
        what = "nothing" if prev is None else prev.describe()
        raise UnsupportedBoundary(f"stage {name}: a parallel FFN (declare_ffn(parallel=True)) "
                                  f"follows a PARTIAL attention, not {what}")
    for stage, update in ((prev.describe(), prev.residual.update),
                          (name, declaration.residual.update)):
        if not is_plain(update):
            raise UnsupportedBoundary(f"stage {name}: a parallel block sums its attention's and "
                                      f"FFN's outputs before the update, so both updates must "
                                      f"be plain adds; {stage} has {update!r}")
    if BatchVariant.SEQUENCE_PARALLEL in variants:
        raise UnsupportedBoundary(f"stage {name}: a parallel block is not offered in a "
                                  "sequence-parallel batch (its attention completes on "
                                  "scattered rows, which its FFN's partial does not hold)")


def join(stream, value: torch.Tensor, decision, facts) -> torch.Tensor:
    """The FFN's output ``value`` (owing ``decision.owed`` on ``decision.rows``) with the
    attention output set aside on ``stream`` added where its sum counts it once."""
    c = stream.take_beside()
    if c is None:
        raise RuntimeError(NOTHING_TO_JOIN.format(stage=stream.stage.name))
    part = c.value.complete() if c.handoff else c.value
    # nothing owed: a TP group of one rank (an output completed in compute, postprocess(),
    # is refused by the stage), so the attention's output is all here
    if facts is None or decision.owed is None:
        return _add(value, part)
    layouts, rows = facts.layouts, c.rows
    if c.owed is None:  # complete: one of the ranks holding these rows adds it
        if rows not in (layouts.local, layouts.attention):
            part = facts.movement(None, rows, layouts.local).move(facts, part)
            rows = layouts.local
        if not _adds(facts, rows, layouts):
            return value
    if rows == decision.rows:  # no attention DP or CP: the same rows, the same ranks
        return _add(value, part)
    if rows == layouts.local:  # this DP rank's segment of the global rows
        start, end = facts.offset, facts.offset + part.shape[0]
        return value.slice_scatter(_add(value[start:end], part), 0, start, end)
    # a CP share: its rows, wherever they are in the global ones
    return value.index_add(0, facts.share_global, part.to(value.dtype))


def _adds(facts, rows, layouts) -> bool:
    """Whether this rank adds a complete value on ``rows``: attention-TP rank 0 of the ranks
    holding them (on local rows in a CP batch, of CP rank 0's too)."""
    parallel = facts.parallel
    if facts.attn_tp > 1 and parallel.attn_tp_rank != 0:
        return False
    return not (rows == layouts.local and facts.table.cp and parallel.attn_cp_rank != 0)


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype is torch.float32 and b.dtype is torch.float32:
        return a + b
    acc = accumulate_dtype(a.dtype)
    return (a.to(dtype=acc) + b.to(dtype=acc)).to(dtype=a.dtype)
