"""GPT-NeoX (parallel blocks with two norms) through the engine's run on gloo ranks against
world 1, and the one sum a layer it costs: a 3-layer prefill at tp 2 under ar runs one
all-reduce a layer plus the embedding's."""

from __future__ import annotations

import pytest
from checkpoints.gpt_neox import hf_neox

from layer_boundary.engine.runner import RunSpec

from .checks import assert_one_all_reduce_a_layer, run_matching_world1

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))  # dp 4 leaves a rank idle
STEPS = 3


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory):
    return str(hf_neox(tmp_path_factory.mktemp("neox") / "n", num_hidden_layers=3))


@pytest.mark.timeout(240)
def test_tp2_ar_runs_one_all_reduce_a_layer(neox_dir):
    spec = RunSpec(neox_dir, tp=2, dp=1, boundary_reduction="ar", prompts=PROMPTS,
                   max_new_tokens=STEPS)
    assert_one_all_reduce_a_layer(spec)


@pytest.mark.timeout(240)
def test_attention_dp_with_an_idle_rank_matches_world1(neox_dir):
    spec = RunSpec(neox_dir, tp=4, dp=4, boundary_reduction="auto", prompts=PROMPTS,
                   max_new_tokens=STEPS)
    run_matching_world1(spec, "rsv")
