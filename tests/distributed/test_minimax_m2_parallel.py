"""MiniMax-M2 (q/k norms over every head, half of each head rotating, the bias-steered
sigmoid router on every layer) through the engine's run on gloo ranks against world 1, a
prefill and KV-cache decode steps: the norms' squares summed over attention TP 2 and 4 (kv
heads replicated over rank pairs at 4, counted once), experts over EP 2 (each split over
moe_tp 2) and EP 4, attention DP with an idle DP rank, a sequence-parallel batch, the
all-to-all MoE, a pipeline cut and a CP batch."""

from __future__ import annotations

import pytest
from checkpoints.mixtral import hf_minimax_m2

from layer_boundary.engine.runner import RunSpec

from .checks import run_matching_world1
from .test_moe_a2a import check_run

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))  # dp 4 leaves a rank idle
STEPS = 3

# (tp, dp, ep, pp, cp, policy, sequence parallel, row mode of the prefill)
CASES = [
    (4, 1, 2, 1, 1, "ar", False, "ar"),
    (4, 4, 4, 1, 1, "rs+rsv", False, "rsv"),
    (4, 2, 2, 1, 1, "rs", True, "rs"),
    (2, 1, 2, 2, 1, "rs", False, "rs"),
    (4, 1, 4, 1, 2, "ar", False, "ar"),
]


@pytest.fixture(scope="module")
def minimax_dir(tmp_path_factory):
    return str(hf_minimax_m2(tmp_path_factory.mktemp("minimax_m2")))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,ep,pp,cp,policy,sp,mode", CASES,
                         ids=[f"tp{c[0]}-dp{c[1]}-ep{c[2]}-pp{c[3]}-cp{c[4]}-{c[5]}"
                              + ("-sp" if c[6] else "") for c in CASES])
def test_matches_world1(minimax_dir, tp, dp, ep, pp, cp, policy, sp, mode):
    run_matching_world1(RunSpec(minimax_dir, tp=tp, dp=dp, ep=ep, pp=pp, cp=cp,
                                boundary_reduction=policy, sequence_parallel=sp,
                                prompts=PROMPTS, max_new_tokens=STEPS), mode)


@pytest.mark.timeout(240)
def test_all_to_all_moe_matches_world1(minimax_dir):
    check_run(RunSpec(minimax_dir, tp=4, dp=1, ep=4, boundary_reduction="rs", prompts=PROMPTS,
                      max_new_tokens=2, moe_a2a_backend="all_to_all"))
