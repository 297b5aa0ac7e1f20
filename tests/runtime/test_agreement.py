"""One decision on every rank: with the agreement check on, ranks that decide differently
(here: one rank's fusion provider declines where the others accept) end with an error that
names the decision, the stage and the ranks, before the collective that would sum the wrong
tensors, instead of running on or hanging."""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, ToyLayer, batch, runtime

from layer_boundary.fusions import Declined
from layer_boundary.fusions.reference import ReferenceFusions
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime.agreement import DisagreementError, checking, first_difference
from layer_boundary.runtime.norm import RMSNorm


class DeclinesOn(ReferenceFusions):
    """The reference provider, whose candidates decline on one rank only (a per-rank
    autotuning choice, a workspace on one rank: what makes ranks decide apart)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def _input(self, plan):
        candidates = super()._input(plan)
        if plan.parallel.rank != self.rank:
            return candidates
        for c in candidates:
            object.__setattr__(c, "run", lambda arrival: Declined("this rank's tactic"))
        return candidates


def forward_with_check(declining_rank: int | None, check: bool = True):
    """A toy forward at tp 2 with the reference provider (declining on ``declining_rank``):
    its output, or the ``DisagreementError`` it raised, as text."""
    with checking(check):
        fusions = (ReferenceFusions() if declining_rank is None
                   else DeclinesOn(declining_rank))
        rt = runtime(2)
        layers = [ToyLayer(rt, i, 3, fusions=fusions) for i in range(3)]
        fb = batch(5)
        residual_batch.start(fb)
        h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))
        try:
            for layer in layers:
                h = layer.forward_layer(h, fb)
            return residual_batch.norm(h, fb, RMSNorm(HIDDEN))
        except DisagreementError as exc:
            return str(exc)


@pytest.mark.timeout(60)  # a hang would be the pool's timeout, not an answer
def test_one_rank_declining_where_the_other_accepts_is_named_on_every_rank():
    results = get_pool(2).run(forward_with_check, 1, timeout=30)
    # rank 0's candidate accepted (it went on to the collective it fuses), rank 1's declined:
    # both stop at that collective's check with the same words
    assert results[0] == results[1] == (
        "ranks decided differently before a collective: layer1.attn fusion candidate 0: "
        "rank 0: went on to all_reduce over tp (40 x torch.float32); rank 1: this rank's "
        "tactic")


def test_ranks_that_agree_run_as_without_the_check():
    checked = get_pool(2).run(forward_with_check, None, True)
    plain = get_pool(2).run(forward_with_check, None, False)
    for a, b in zip(checked, plain):
        assert isinstance(a, torch.Tensor), a
        assert torch.equal(a, b)


def test_the_first_difference_names_the_site_the_decision_and_each_ranks_value():
    same = ("forward", "rows", "ordinary ar")
    notes = [[same, ("layer1.attn", "fusion candidate 0", "declined: x")],
             [same, ("all_reduce over tp", "collective", "8 x torch.float32")],
             [same, ("layer1.attn", "fusion candidate 0", "declined: x")]]
    assert first_difference(notes, (4, 5, 6)) == (
        "ranks decided differently before a collective: layer1.attn fusion candidate 0: "
        "ranks 4, 6: declined: x; rank 5: went on to all_reduce over tp (8 x torch.float32)")
    assert first_difference([[same], [same, same]], (0, 1)) == (
        "ranks decided differently before a collective: forward rows: rank 0: nothing more "
        "(its notes end here); rank 1: ordinary ar")


def test_run_check_agreement_passes_where_the_ranks_agree(capsys, restore_logger):
    """The default job (tp 4, attention DP 2, ``auto``) with the flag: every collective's
    group agrees, so the run is what it is without it."""
    from distributed.checks import cli

    code, out = cli(["run", "--check-agreement", "--max-new-tokens", "2"], capsys)
    assert code == 0
    assert "parity vs world 1: PASS" in out
