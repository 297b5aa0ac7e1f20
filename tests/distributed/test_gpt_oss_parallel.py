"""GPT-OSS under TP, attention DP, expert parallelism (gathered and all-to-all), a pipeline
and context parallelism on gloo ranks against world 1 (which matches transformers: the oracle
tests): attention heads and their sinks over attention TP (kv heads replicated at 4), o_proj's
bias once in the boundary's sum, sliding layers whose window the prompts outgrow, experts over
moe_ep x moe_tp with each expert's down bias added once per token, a prefill then cached
decode steps."""

from __future__ import annotations

import pytest
from checkpoints.gpt_oss import hf_gpt_oss

from layer_boundary.engine.runner import RunSpec

from .checks import run_matching_world1

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))  # window 3: outgrown
STEPS = 3

# (tp, attn_dp, moe_ep, cp, pp, moe_a2a_backend, policy, expected row mode of the prefill)
CASES = [
    (2, 1, 1, 1, 1, "none", "ar", "ar"),  # heads and sinks split, experts over TP
    (4, 1, 4, 1, 1, "none", "rs", "rs"),  # pure EP; kv heads replicated at attention TP 4
    (4, 2, 2, 1, 1, "none", "rsv", "rsv"),  # attention DP 2, experts over 2 x 2
    (4, 1, 2, 1, 1, "all_to_all", "auto", "rsv"),  # dispatched, moe_tp 2: one down bias
    (2, 1, 2, 1, 2, "none", "auto", "ar"),  # a pipeline of 2 stages of 2 layers
    (2, 1, 1, 2, 1, "none", "auto", "rsv"),  # CP shares of each sliding window
]


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    return str(hf_gpt_oss(tmp_path_factory.mktemp("gpt_oss")))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,ep,cp,pp,a2a,policy,mode", CASES,
                         ids=[f"tp{c[0]}-dp{c[1]}-ep{c[2]}-cp{c[3]}-pp{c[4]}-{c[5]}-{c[6]}"
                              for c in CASES])
def test_matches_world1(gpt_oss_dir, tp, dp, ep, cp, pp, a2a, policy, mode):
    spec = RunSpec(gpt_oss_dir, tp=tp, dp=dp, ep=ep, cp=cp, pp=pp, moe_a2a_backend=a2a,
                   boundary_reduction=policy, prompts=PROMPTS, max_new_tokens=STEPS)
    run_matching_world1(spec, mode)
