"""Mixtral (a sliding window shorter than the prompts, every layer a MoE) through the engine's
run on gloo ranks against world 1, a prefill and KV-cache decode steps: heads over attention
TP, experts over EP 2 (each split over moe_tp 2) and EP 4 (one a rank), attention DP under rs
and rsv, the all-to-all MoE (its four all-to-alls per MoE layer and step), a pipeline cut and
a CP batch (the window on each share)."""

from __future__ import annotations

import pytest
from checkpoints.mixtral import hf_mixtral

from layer_boundary.engine.runner import RunSpec

from .checks import run_matching_world1
from .test_moe_a2a import check_run

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))  # 9 and 5 tokens > WINDOW
STEPS = 3

# (tp, dp, ep, pp, cp, policy, row mode of the prefill)
CASES = [
    (2, 1, 2, 1, 1, "ar", "ar"),
    (4, 2, 4, 1, 1, "rsv", "rsv"),
    (4, 1, 2, 1, 1, "rs", "rs"),
    (2, 1, 2, 2, 1, "rs", "rs"),
    (2, 1, 1, 1, 2, "ar", "ar"),
]


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return str(hf_mixtral(tmp_path_factory.mktemp("mixtral")))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,ep,pp,cp,policy,mode", CASES,
                         ids=[f"tp{c[0]}-dp{c[1]}-ep{c[2]}-pp{c[3]}-cp{c[4]}-{c[5]}"
                              for c in CASES])
def test_matches_world1(mixtral_dir, tp, dp, ep, pp, cp, policy, mode):
    run_matching_world1(RunSpec(mixtral_dir, tp=tp, dp=dp, ep=ep, pp=pp, cp=cp,
                                boundary_reduction=policy, prompts=PROMPTS,
                                max_new_tokens=STEPS), mode)


@pytest.mark.timeout(240)
def test_all_to_all_moe_matches_world1(mixtral_dir):
    check_run(RunSpec(mixtral_dir, tp=4, dp=2, ep=4, boundary_reduction="rsv", prompts=PROMPTS,
                      max_new_tokens=2, moe_a2a_backend="all_to_all"))
