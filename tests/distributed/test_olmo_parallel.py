"""OLMo-2 and OLMo-3 (post norms as residual updates, q/k norms over every head summed over
attention TP, OLMo-3's sliding layers) through the engine's run on gloo ranks against world 1:
TP, attention DP with rs/rsv and an idle DP rank, a sequence-parallel batch, a pipeline cut
(each post norm applied on its own layer's rank), a CP batch (the window on each share), with
a prefill and KV-cache decode steps."""

from __future__ import annotations

import pytest
from checkpoints.olmo import hf_olmo2, hf_olmo3

from layer_boundary.engine.runner import RunSpec

from .checks import run_matching_world1

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))  # dp 4 leaves a rank idle
STEPS = 3

# (model, tp, dp, pp, cp, policy, sequence parallel, row mode of the prefill)
CASES = [
    ("olmo3", 2, 1, 1, 1, "ar", False, "ar"),
    ("olmo3", 4, 2, 1, 1, "rsv", False, "rsv"),
    ("olmo3", 2, 1, 2, 1, "rs", False, "rs"),
    ("olmo3", 2, 1, 1, 2, "ar", False, "ar"),
    ("olmo2", 4, 2, 1, 1, "rs", True, "rs"),
    ("olmo2", 4, 4, 1, 1, "auto", False, "rsv"),
]


@pytest.fixture(scope="module")
def olmo_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("olmo")
    return {"olmo2": str(hf_olmo2(root / "olmo2")), "olmo3": str(hf_olmo3(root / "olmo3"))}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model,tp,dp,pp,cp,policy,sp,mode", CASES,
                         ids=[f"{c[0]}-tp{c[1]}-dp{c[2]}-pp{c[3]}-cp{c[4]}-{c[5]}"
                              + ("-sp" if c[6] else "") for c in CASES])
def test_matches_world1(olmo_dirs, model, tp, dp, pp, cp, policy, sp, mode):
    spec = RunSpec(olmo_dirs[model], tp=tp, dp=dp, pp=pp, cp=cp, boundary_reduction=policy,
                   sequence_parallel=sp, prompts=PROMPTS, max_new_tokens=STEPS)
    run_matching_world1(spec, mode)
