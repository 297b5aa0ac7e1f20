"""Every reference model with two-batch overlap (``--tbo``) on gloo ranks: each forward split
into two microbatches with their own streams, interleaved layer by layer, against world 1
(every step's logits, same tokens) and transformers (every request's prefill logits), at tp 2
and tp=4 dp=2 with EP under ar/rs/rsv/auto. PROMPTS puts two requests on DP rank 0 and one on
DP rank 1, so the second microbatch holds no tokens on DP rank 1 in the prefill, and none
anywhere in decode."""

from __future__ import annotations

import pytest

from layer_boundary.adapters.tbo import TboPolicy, split_counts
from layer_boundary.engine.generate import requests_of
from layer_boundary.engine.runner import RunSpec, merge

from .checks import run_matching_world1
from .models import MODELS, PROMPTS, STEPS, transformers_prefill

# (tp, dp, ep, policy, expected row mode)
CASES = {
    "tp2-rs": (2, 1, 1, "rs", "rs"),
    "tp4-dp2-ep2-ar": (4, 2, 2, "ar", "ar"),
    "tp4-dp2-ep2-rs": (4, 2, 2, "rs", "rs"),
    "tp4-dp2-ep2-rsv": (4, 2, 2, "rsv", "rsv"),
    "tp4-dp2-ep2-auto": (4, 2, 2, "auto", "rsv"),
}


def test_the_prefill_leaves_a_microbatch_empty_on_a_dp_rank():
    lens = tuple(tuple(len(PROMPTS[i]) for i in requests_of(d, 2, len(PROMPTS)))
                 for d in range(2))
    first, second = split_counts(lens)
    assert first == (9, 2) and second == (5, 0)


# every model at tp 2 and with attention DP in rsv; the other modes, and auto (which resolves
# from the layout and the batch, not the model), on a dense model and a dense-first MoE
# (DeepSeek-V3): the row modes themselves are proven on the toy stack (adapters/test_tbo.py)
RUNS = [(model, case) for model in MODELS for case in CASES
        if case in ("tp2-rs", "tp4-dp2-ep2-rsv") or model in ("qwen3", "deepseek_v3")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model,case", RUNS, ids=[f"{m}-{c}" for m, c in RUNS])
def test_tbo_matches_world1_and_transformers(model_dirs, model, case):
    tp, dp, ep, policy, mode = CASES[case]
    spec = RunSpec(model_dirs[model], tp=tp, dp=dp, ep=ep, boundary_reduction=policy,
                   prompts=PROMPTS, max_new_tokens=STEPS, tbo=TboPolicy.ALWAYS)
    run = merge(run_matching_world1(spec, mode))
    for j, expected in enumerate(transformers_prefill(model, model_dirs[model])):
        diff = (run.logits[j][0] - expected).abs().max().item()
        assert diff <= 1e-5, f"request {j} prefill vs transformers: max abs diff {diff}"
