"""MoE blocks on the Transformers backend on real gloo ranks against world 1: a Qwen2-MoE
(routed experts beside a gated shared expert; no model file of ours) with each expert's
intermediate split over moe_tp 2 and its experts over EP 2, at tp 4 with attention DP 2 under
rsv and a DP rank with no request; and at tp 2 under ar, where the last layer's block completes
its own sum: its experts' and its shared expert's partials are summed once, as the
exactly-once audit requires."""

from __future__ import annotations

import pytest
from checkpoints.generic import hf_tiny

from layer_boundary.engine.runner import RunSpec

from .checks import run_matching_world1, sums_of_ffn_outputs

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))
STEPS = 3
LAYERS = 3


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    from layer_boundary.models.checkpoint import open_checkpoint

    folder = hf_tiny("qwen2_moe", tmp_path_factory.mktemp("generic_moe") / "qwen2_moe",
                     num_hidden_layers=LAYERS, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, shared_expert_intermediate_size=48)
    return open_checkpoint(folder)  # auto: the backend (no qwen2_moe file of ours)


@pytest.mark.timeout(240)
def test_tp4_dp2_ep2_rsv_with_an_idle_dp_rank(qwen2_moe):
    assert qwen2_moe.impl == "transformers"
    spec = RunSpec(qwen2_moe.folder, checkpoint=qwen2_moe, tp=4, dp=2, ep=2,
                   boundary_reduction="rsv", prompts=PROMPTS[:1], max_new_tokens=STEPS)
    for r in run_matching_world1(spec, "rsv"):
        assert r.audit == [] and r.unaudited is None, (r.rank, r.audit)


@pytest.mark.timeout(240)
def test_tp2_ar_sums_each_block_once(qwen2_moe):
    spec = RunSpec(qwen2_moe.folder, checkpoint=qwen2_moe, tp=2, boundary_reduction="ar",
                   prompts=PROMPTS, max_new_tokens=STEPS)
    for r in run_matching_world1(spec, "ar"):
        assert r.audit == [] and r.unaudited is None, (r.rank, r.audit)
        for step in range(STEPS):
            sums = sums_of_ffn_outputs(r.ledger, LAYERS, step)
            assert all(len(s) == 1 for s in sums.values()), (r.rank, step, sums)
