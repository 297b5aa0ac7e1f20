"""Inkling's text model (short convolutions as residual updates, relative-bias attention,
dense and MoE layers with shared experts) through the engine's run on gloo ranks against
world 1, a prefill and KV-cache decode steps: attention TP with attention DP and EP under
``auto`` (which is ``ar`` for it) and ``rsv``, the all-to-all MoE with an idle DP rank, and
a pipeline cut (each stage's last layer folds its update in before the cut)."""

from __future__ import annotations

import pytest
from checkpoints.inkling import hf_inkling

from layer_boundary.adapters.tbo import TboPolicy
from layer_boundary.engine.runner import RunSpec

from .checks import A2A, run_matching_world1

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))  # dp 4 leaves a rank idle
STEPS = 3

# (tp, dp, ep, pp, other RunSpec fields, row mode of the prefill): auto is ar for it; rsv
# completes each output onto the DP rank's own rows, where the convolution runs
CASES = [
    (4, 2, 2, 1, {}, "ar"),
    (4, 2, 2, 1, {"boundary_reduction": "rsv"}, "rsv"),
    (4, 4, 4, 1, A2A, "ar"),
    (2, 1, 1, 2, {}, "ar"),
    # two-batch overlap under rs: a microbatch issued its owed sum early onto the scattered
    # rows, which the convolution's consumer does not take (a RuntimeError on every rank)
    (2, 1, 1, 1, {"boundary_reduction": "rs", "tbo": TboPolicy.ALWAYS}, "rs"),
]


@pytest.fixture(scope="module")
def inkling_dir(tmp_path_factory):
    return str(hf_inkling(tmp_path_factory.mktemp("inkling") / "inkling"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,ep,pp,options,mode", CASES,
                         ids=[f"tp{c[0]}-dp{c[1]}-ep{c[2]}-pp{c[3]}-{c[5]}" + "".join(
                             f"-{k}" for k in c[4] if k != "boundary_reduction")
                              for c in CASES])
def test_matches_world1(inkling_dir, tp, dp, ep, pp, options, mode):
    spec = RunSpec(inkling_dir, tp=tp, dp=dp, ep=ep, pp=pp,
                   **{"boundary_reduction": "auto", **options},
                   prompts=PROMPTS, max_new_tokens=STEPS)
    results = run_matching_world1(spec, mode)
    if "moe_a2a_backend" in options:  # the routed tokens were dispatched
        assert all(any(e.kind == "all_to_all" for e in r.ledger) for r in results)
