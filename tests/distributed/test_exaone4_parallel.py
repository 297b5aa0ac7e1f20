"""EXAONE-4 (post norms as residual updates, the residual read as it is, per-head q/k norms,
sliding layers and an unroped full one) through the engine's run on gloo ranks against world
1: attention DP with an idle DP rank, a sequence-parallel batch, a CP batch, with a prefill
and KV-cache decode steps."""

from __future__ import annotations

import pytest
from checkpoints.exaone4 import hf_exaone4

from layer_boundary.engine.runner import RunSpec

from .checks import run_matching_world1

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))  # dp 4 leaves a rank idle
STEPS = 3

# (tp, dp, cp, policy, sequence parallel, row mode of the prefill)
CASES = [
    (4, 4, 1, "auto", False, "rsv"),
    (4, 1, 1, "rs", True, "rs"),
    (4, 2, 2, "ar", False, "ar"),
]


@pytest.fixture(scope="module")
def exaone4_dir(tmp_path_factory):
    return str(hf_exaone4(tmp_path_factory.mktemp("exaone4") / "exaone4"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,cp,policy,sp,mode", CASES,
                         ids=[f"tp{c[0]}-dp{c[1]}-cp{c[2]}-{c[3]}" + ("-sp" if c[4] else "")
                              for c in CASES])
def test_matches_world1(exaone4_dir, tp, dp, cp, policy, sp, mode):
    spec = RunSpec(exaone4_dir, tp=tp, dp=dp, cp=cp, boundary_reduction=policy,
                   sequence_parallel=sp, prompts=PROMPTS, max_new_tokens=STEPS)
    run_matching_world1(spec, mode)
