"""A capability counts only where a read or update declares it itself.

A read that subclasses the add+norm read to compute something else, or an update that
subclasses the plain add, inherits the class attributes (``kind``, ``plain``) that offer the
fused add+norm kernel and the add-on-one-rank shortcut. Neither may stand in for it: the
numbers on every row mode, with the reference provider offering its candidate to every input,
equal world 1 run without a provider, and nothing is accepted. A subclass that declares
``kind = "add_norm"`` again (computing the same) is offered the kernel and takes it, so the
check can fail.
"""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, DpBatch, ToyStack, runtime, seeded

from layer_boundary.fusions.reference import ReferenceFusions
from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual import is_plain, read_kind
from layer_boundary.residual.add_norm import AddNormRead, PlainAdd, accumulate_dtype


class DoubledRead(AddNormRead):
    """The add+norm read with its compute input doubled: a custom read by inheritance."""

    def enter(self, hidden, norm):
        return 2 * norm(hidden), hidden

    def read(self, residual, norm):
        return 2 * norm(residual), residual

    def update_and_read(self, update, residual, contribution, norm):
        residual = contribution if residual is None else update.apply(residual, contribution)
        return self.read(residual, norm)


class OptedInRead(AddNormRead):
    """Computes what its parent does and says so: the fused kernel may stand in for it."""

    kind = "add_norm"


class HalfAdd(PlainAdd):
    """residual + contribution / 2: not a plain add, though it subclasses one."""

    def apply(self, residual, contribution):
        if residual is None:
            return contribution / 2
        acc = accumulate_dtype(residual.dtype)
        return (residual.to(acc) + contribution.to(acc) / 2).to(residual.dtype)


READS = {"doubled": dict(attn_read=DoubledRead(), ffn_read=DoubledRead()),
         "half-add": dict(ffn_update=HalfAdd()),
         "opted-in": dict(attn_read=OptedInRead(), ffn_read=OptedInRead())}


def run(tp: int, dp: int, policy: str, counts, which: str, provider: bool) -> dict:
    rt = runtime(tp, dp, boundary_reduction=policy)
    fusions = ReferenceFusions() if provider else None
    stack = ToyStack(rt, 3, fusions=fusions, **READS[which])
    b = DpBatch(counts, rt)
    residual_batch.start(b.fb)
    h = b.mine(seeded((sum(counts), HIDDEN), 4))
    for layer in stack.layers:
        h = layer.forward_layer(h, b.fb)
    out = stack.final(h, b.fb)
    return {"out": out, "rows": (b.rows.start, b.rows.stop), "mode": b.fb.rows.mode.value,
            "accepted": fusions.accepted if fusions else 0}


CASES = [(1, 1, "ar", (5,)), (2, 1, "ar", (5,)), (2, 1, "rs", (5,)), (4, 2, "ar", (5, 3)),
         (4, 2, "rs", (5, 3)), (4, 2, "rsv", (3, 5)), (4, 2, "ar", (0, 5)),
         (4, 2, "rsv", (5, 0))]


def test_capabilities_are_not_inherited():
    assert read_kind(DoubledRead()) is None and read_kind(OptedInRead()) == "add_norm"
    assert read_kind(AddNormRead()) == "add_norm"
    assert not is_plain(HalfAdd()) and is_plain(PlainAdd())


def test_the_custom_compute_changes_the_numbers():
    """Guards the comparison below: each subclass computes something else than its parent."""
    plain = run(1, 1, "ar", (5,), "opted-in", False)["out"]
    for which in ("doubled", "half-add"):
        assert (run(1, 1, "ar", (5,), which, False)["out"] - plain).abs().max() > 1e-2, which


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["doubled", "half-add", "opted-in"])
@pytest.mark.parametrize("tp,dp,policy,counts", CASES,
                         ids=[f"tp{t}-dp{d}-{p}-{'_'.join(map(str, c))}" for t, d, p, c in CASES])
def test_a_subclass_is_never_replaced_by_the_fused_kernel(tp, dp, policy, counts, which):
    ref = run(1, 1, "ar", counts, which, False)["out"]
    results = get_pool(tp).run(run, tp, dp, policy, counts, which, True) if tp > 1 else [
        run(1, 1, policy, counts, which, True)]
    for rank, r in enumerate(results):
        assert r["mode"] == policy
        torch.testing.assert_close(r["out"], ref[slice(*r["rows"])], atol=1e-5, rtol=0,
                                   msg=lambda m: f"rank {rank}: {m}")
        if which == "opted-in":
            if policy == "ar":  # the reference kernel all-reduces: it stands in on ar only
                assert r["accepted"] > 0
        elif which == "doubled":
            assert r["accepted"] == 0
        # half-add: the FFN inputs still take the kernel for the attention's plain add
