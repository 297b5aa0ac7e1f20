"""Gemma-3 text (sandwich norms: input norms on the consumers, post norms as the producers'
residual updates; a scaled embedding; sliding and full layers) through the engine's run on
gloo ranks against world 1: TP, attention DP with rsv, a pipeline cut (each post norm applied
on its own layer's rank, the tied head on the last), a CP batch (the window on each share),
with a prefill and KV-cache decode steps."""

from __future__ import annotations

import pytest
from checkpoints.gemma3 import hf_gemma3

from layer_boundary.engine.runner import RunSpec

from .checks import run_matching_world1

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))
STEPS = 3

# (tp, dp, pp, cp, policy, row mode of the prefill)
CASES = [
    (2, 1, 1, 1, "ar", "ar"),
    (4, 2, 1, 1, "rsv", "rsv"),
    (2, 1, 2, 1, "rs", "rs"),
    (2, 1, 1, 2, "ar", "ar"),
]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return str(hf_gemma3(tmp_path_factory.mktemp("gemma3") / "gemma3"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,pp,cp,policy,mode", CASES,
                         ids=[f"tp{c[0]}-dp{c[1]}-pp{c[2]}-cp{c[3]}-{c[4]}" for c in CASES])
def test_matches_world1(gemma3_dir, tp, dp, pp, cp, policy, mode):
    spec = RunSpec(gemma3_dir, tp=tp, dp=dp, pp=pp, cp=cp, boundary_reduction=policy,
                   prompts=PROMPTS, max_new_tokens=STEPS)
    run_matching_world1(spec, mode)
