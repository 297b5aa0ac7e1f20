"""GLM-4.5 (glm4_moe) under TP, expert parallelism (EP 2, EP 4, the all-to-all MoE),
attention DP, sequence, context and pipeline parallelism on gloo ranks against world 1: GQA
heads over attention TP (kv heads replicated over rank pairs at 4) with q/k norms and partial
rotary, DeepSeek-V3's grouped sigmoid router, dense and shared experts over TP, routed experts
over moe_ep x moe_tp, prefill and KV-cache decode."""

from __future__ import annotations

import pytest
from checkpoints.glm4_moe import hf_glm4_moe

from .checks import MOE_TOPOLOGIES, run_moe_topology, topology_id

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))
STEPS = 2  # a prefill, then a KV-cache decode step
# and a sequence-parallel prefill: the attention's linears gather and reduce-scatter the rows
CASES = MOE_TOPOLOGIES + [(4, 1, 4, "rs", {"sequence_parallel": True}, "rs")]


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return hf_glm4_moe(tmp_path_factory.mktemp("glm4_moe"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES, ids=map(topology_id, CASES))
def test_matches_world1(glm_dir, case):
    run_moe_topology(glm_dir, case, PROMPTS, STEPS)
