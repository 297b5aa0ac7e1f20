"""Context parallelism: what attention needs to compute on its CP share.

In a CP batch (``ForwardBatch.variant`` CP, on a topology with ``attn_cp`` > 1) each CP rank
holds a share of its DP rank's tokens: every request cut into 2 x cp contiguous chunks, rank
r taking chunks r and 2cp-1-r (``ops.cp_shares``; every rank derives the same mapping from
the batch's request lengths). The boundary keeps the residual, the norms and the FFN's rows
on the shares and moves rows with the table's movements; attention computes its queries on
its share and needs every token of its DP rank as keys and values. ``cp_view`` gives it, from
the forward's row facts, with the same mapping:

- ``share(x)``: a per-token tensor of the DP rank (its positions) onto this share;
- ``gather(x)``: a share's rows (its keys and values, or an MLA latent) back to every token of
  the DP rank in token order: an all-gather over CP (the table's movement from attention
  rows to local rows);
- ``queries``: the token index of each share row, for ``cached_attention``, which writes
  every token's keys and values into the cache and masks each query by its position.

Outside a CP batch ``cp_view`` is None and attention runs as it always does. Decode steps run
as CP batches too: a one-token request lands on CP rank 0 (chunk 0), so decode puts every
new token there, and every CP rank keeps the whole cache.
"""

from __future__ import annotations

import torch

__all__ = ["CpView", "cp_view"]


class CpView:
    """This CP rank's share of its DP rank's tokens in one forward."""

    __slots__ = ("facts", "_share", "_gather")

    def __init__(self, facts) -> None:
        layouts = facts.layouts
        self.facts = facts
        self._share = facts.movement(None, layouts.local, layouts.attention)
        self._gather = facts.movement(None, layouts.attention, layouts.local)

    @property
    def queries(self) -> torch.Tensor:
        """The token index (in the DP rank's tokens) of each row of the share."""
        return self.facts.cp_index

    def share(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (one row per token of the DP rank) on this share's rows."""
        return self._share.move(self.facts, x)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (one row per token of this share) for every token of the DP rank, in token
        order: every CP rank of the DP rank joins."""
        return self._gather.move(self.facts, x)


def cp_view(forward_batch) -> CpView | None:
    """The CP share of this forward (after a boundary placed its rows), or None outside a CP
    batch."""
    facts = forward_batch.row_facts
    if facts is None or not facts.table.cp:
        return None
    return CpView(facts)
