"""Cohere and Cohere2 (parallel blocks) through the engine's run on gloo ranks against world
1, and the one sum a layer they cost: a 3-layer Cohere prefill at tp 2 under ar runs one
all-reduce a layer (each layer's attention partial joins its MLP's sum) plus the
embedding's."""

from __future__ import annotations

import pytest
from checkpoints.cohere import hf_cohere, hf_cohere2

from layer_boundary.engine.runner import RunSpec

from .checks import assert_one_all_reduce_a_layer, run_matching_world1

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))  # dp 4 leaves a rank idle
STEPS = 3


@pytest.fixture(scope="module")
def cohere_dir(tmp_path_factory):
    return str(hf_cohere(tmp_path_factory.mktemp("cohere") / "c", num_hidden_layers=3))


@pytest.fixture(scope="module")
def cohere2_dir(tmp_path_factory):
    return str(hf_cohere2(tmp_path_factory.mktemp("cohere2") / "c2"))


@pytest.mark.timeout(240)
def test_tp2_ar_runs_one_all_reduce_a_layer(cohere_dir):
    spec = RunSpec(cohere_dir, tp=2, dp=1, boundary_reduction="ar", prompts=PROMPTS,
                   max_new_tokens=STEPS)
    assert_one_all_reduce_a_layer(spec)


# (tp, dp, cp, policy, row mode of the prefill)
CASES = [(4, 4, 1, "auto", "rsv"), (4, 2, 2, "rs", "rs")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,cp,policy,mode", CASES,
                         ids=[f"tp{c[0]}-dp{c[1]}-cp{c[2]}-{c[3]}" for c in CASES])
def test_cohere2_matches_world1(cohere2_dir, tp, dp, cp, policy, mode):
    spec = RunSpec(cohere2_dir, tp=tp, dp=dp, cp=cp, boundary_reduction=policy,
                   prompts=PROMPTS, max_new_tokens=STEPS)
    run_matching_world1(spec, mode)
