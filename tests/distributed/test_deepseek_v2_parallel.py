"""DeepSeek-V2 under TP, expert parallelism (EP 2, EP 4, the all-to-all MoE), attention DP,
context and pipeline parallelism on gloo ranks against world 1: MLA heads over attention TP
without q LoRA (in an input-scattered batch the moved qkv latent carries the normalized input
itself), softmax group-limited routing, dense and shared experts over TP, routed experts over
moe_ep x moe_tp, prefill and KV-cache decode."""

from __future__ import annotations

import pytest
from checkpoints.deepseek_v2 import hf_deepseek_v2

from .checks import MOE_TOPOLOGIES, run_moe_topology, topology_id

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))
STEPS = 2  # a prefill, then a KV-cache decode step
CASES = MOE_TOPOLOGIES + [(4, 1, 4, "rs", {"attn_input_scattered": True}, "rs")]


@pytest.fixture(scope="module")
def ds2_dir(tmp_path_factory):
    return hf_deepseek_v2(tmp_path_factory.mktemp("deepseek_v2"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES, ids=map(topology_id, CASES))
def test_matches_world1(ds2_dir, case):
    run_moe_topology(ds2_dir, case, PROMPTS, STEPS)
