"""Phi-3 (fused q/k/v and gate/up checkpoint tensors, each rank reading its rows; partial
rotary; a sliding window) through the engine's run on gloo ranks against world 1: TP with kv
heads replicated, attention DP with rsv, a pipeline cut, with a prefill and KV-cache decode
steps past the window."""

from __future__ import annotations

import pytest
from checkpoints.phi3 import hf_phi3

from layer_boundary.engine.runner import RunSpec

from .checks import run_matching_world1

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))
STEPS = 3

# (tp, dp, pp, policy, row mode of the prefill)
CASES = [
    (4, 1, 1, "ar", "ar"),  # 2 kv heads over 4 ranks: each replicated on two
    (4, 2, 1, "rsv", "rsv"),
    (2, 1, 2, "rs", "rs"),
]


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return str(hf_phi3(tmp_path_factory.mktemp("phi3") / "phi3"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,pp,policy,mode", CASES,
                         ids=[f"tp{c[0]}-dp{c[1]}-pp{c[2]}-{c[3]}" for c in CASES])
def test_matches_world1(phi3_dir, tp, dp, pp, policy, mode):
    spec = RunSpec(phi3_dir, tp=tp, dp=dp, pp=pp, boundary_reduction=policy, prompts=PROMPTS,
                   max_new_tokens=STEPS)
    run_matching_world1(spec, mode)
