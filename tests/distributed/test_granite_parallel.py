"""Granite and GraniteMoE (the scaled residual update on every stage, a scaled embedding and
logits) through the engine's run on gloo ranks against world 1, a prefill and KV-cache decode
steps: Granite under attention DP with reduce-scatter rows (rsv); GraniteMoE's experts over EP
2 (each split over moe_tp 2 at tp 4) with attention DP, and dispatched all-to-all over EP 4.
The other layouts (pp 2, bf16, CP) are checked from the command line."""

from __future__ import annotations

import pytest
from checkpoints.granite import hf_granite, hf_granitemoe

from layer_boundary.engine.runner import RunSpec

from .checks import run_matching_world1
from .test_moe_a2a import check_run

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))
STEPS = 3


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory):
    return str(hf_granite(tmp_path_factory.mktemp("granite")))


@pytest.fixture(scope="module")
def granitemoe_dir(tmp_path_factory):
    return str(hf_granitemoe(tmp_path_factory.mktemp("granitemoe")))


@pytest.mark.timeout(240)
def test_granite_matches_world1(granite_dir):
    run_matching_world1(RunSpec(granite_dir, tp=4, dp=2, boundary_reduction="rsv",
                                prompts=PROMPTS, max_new_tokens=STEPS), "rsv")


@pytest.mark.timeout(240)
def test_granitemoe_matches_world1(granitemoe_dir):
    run_matching_world1(RunSpec(granitemoe_dir, tp=4, dp=2, ep=2, boundary_reduction="rs",
                                prompts=PROMPTS, max_new_tokens=STEPS), "rs")


@pytest.mark.timeout(240)
def test_granitemoe_all_to_all_matches_world1(granitemoe_dir):
    check_run(RunSpec(granitemoe_dir, tp=4, dp=2, ep=4, boundary_reduction="rsv",
                      prompts=PROMPTS, max_new_tokens=2, moe_a2a_backend="all_to_all"))
