"""DeepSeek-V3 under TP, expert parallelism and attention DP on gloo ranks against world 1:
MLA heads over attention TP (qkv latent moved instead of the hidden state), dense and shared
experts over TP, routed experts over moe_ep x moe_tp, with and without a fusion provider that
defers the MoE finalize (shared experts riding on the handoff)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from checkpoints.ds import hf_deepseek_v3

from layer_boundary.models import load_config
from layer_boundary.engine.runner import RunSpec, merge, run_rank

from .checks import assert_logits_match, sums_of_ffn_outputs, world1
from .pool import get_pool

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))  # skewed; dp=4 leaves a rank idle
STEPS = 2  # a prefill, then a KV-cache decode step

# (tp, attn_dp, moe_ep): TP-MoE, pure EP, DP with EP x TP experts, attention TP 4 (one head
# per rank) with pure EP, attention DP 4 (attention TP 1) with TP-sharded experts
CONFIGS = [(2, 1, 1), (2, 1, 2), (4, 2, 2), (4, 1, 4), (4, 4, 1)]
POLICIES = ["ar", "rs+rsv"]


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    return str(hf_deepseek_v3(tmp_path_factory.mktemp("deepseek_v3")))


@pytest.fixture(scope="module")
def ds_noqlora_dir(tmp_path_factory):
    """Without q LoRA: q_proj is head-sharded, so the moved latent carries the input itself."""
    return str(hf_deepseek_v3(tmp_path_factory.mktemp("deepseek_v3_noqlora"), seed=2,
                              q_lora_rank=None, norm_topk_prob=False, rope_interleave=False))


def expected_mode(policy: str, tp: int, dp: int) -> str:
    if policy == "ar" or tp == 1:
        return "ar"
    return "rsv" if dp > 1 else "rs"


def assert_matches_world1(spec: RunSpec, results) -> None:
    assert_logits_match(merge(results), world1(spec), len(spec.prompts))


def run(spec: RunSpec):
    return get_pool(spec.tp).run(run_rank, spec)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("tp,dp,ep", CONFIGS, ids=[f"tp{t}-dp{d}-ep{e}" for t, d, e in CONFIGS])
def test_matches_world1(ds_dir, tp, dp, ep, policy):
    spec = RunSpec(ds_dir, tp=tp, dp=dp, ep=ep, boundary_reduction=policy, prompts=PROMPTS,
                   max_new_tokens=STEPS)
    assert_matches_world1(spec, run(spec))


FUSION_CASES = [(2, 1, 2, "ar", "reference"), (4, 2, 2, "ar", "reference-terminal"),
                (4, 2, 2, "rs+rsv", "reference"), (4, 1, 4, "ar", "decline")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,ep,policy,fusions", FUSION_CASES,
                         ids=[f"tp{t}-dp{d}-ep{e}-{p}-{f}" for t, d, e, p, f in FUSION_CASES])
def test_deferred_finalize_with_shared_experts_matches_world1(ds_dir, tp, dp, ep, policy,
                                                               fusions):
    """The provider lets MoE layers return a finalize handoff; ours carries the shared experts'
    partial, completed by the provider's fused input, the final norm's service, or the
    built-in path (a declining provider)."""
    spec = RunSpec(ds_dir, tp=tp, dp=dp, ep=ep, boundary_reduction=policy, prompts=PROMPTS,
                   max_new_tokens=STEPS, fusions=fusions)
    results = run(spec)
    assert_matches_world1(spec, results)
    for r in results:
        if fusions == "decline" or r.modes[0] != "ar":
            assert r.fused_inputs == 0
        else:
            assert r.fused_inputs > 0
        # DeepSeek-V3's final norm is an RMSNorm (no gemma_weight for the terminal service):
        # a terminal handoff reaches it and completes unfused
        assert r.fused_final_norms == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,ep,policy", [(2, 1, 1, "ar"), (4, 1, 4, "rs+rsv")],
                         ids=["tp2-ar", "tp4-ep4-rs"])
def test_without_q_lora_matches_world1(ds_noqlora_dir, tp, dp, ep, policy):
    spec = RunSpec(ds_noqlora_dir, tp=tp, dp=dp, ep=ep, boundary_reduction=policy,
                   prompts=PROMPTS, max_new_tokens=STEPS)
    assert_matches_world1(spec, run(spec))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy,fusions", [
    ("ar", None), ("ar", "reference"), ("ar", "reference-terminal"), ("rs+rsv", None),
    ("rs+rsv", "reference")])
def test_each_ffn_output_is_summed_once(ds_dir, policy, fusions):
    """Routed and shared experts share one TP sum, wherever the boundary owns it."""
    spec = RunSpec(ds_dir, tp=2, ep=2, boundary_reduction=policy, prompts=PROMPTS,
                   max_new_tokens=STEPS, fusions=fusions)
    layers = load_config(ds_dir).num_hidden_layers
    for r in run(spec):
        for step in range(STEPS):
            sums = sums_of_ffn_outputs(r.ledger, layers, step)
            assert all(len(s) == 1 for s in sums.values()), (r.rank, step, sums)


TP1 = (("shared_experts_tp1", True),)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,ep,policy,fusions", [
    (2, 1, 2, "ar", None),  # the tail after the sum compute runs itself
    (2, 1, 2, "ar", "reference-terminal"),  # the tail rides on a finalize handoff, once
    (4, 2, 2, "rs+rsv", None),  # compute skips its sum for a reduce-scatter
    (4, 1, 4, "rs+rsv", "reference"),
])
def test_unsharded_shared_experts_are_a_local_tail_added_once(ds_dir, tp, dp, ep, policy,
                                                               fusions):
    spec = RunSpec(ds_dir, tp=tp, dp=dp, ep=ep, boundary_reduction=policy, prompts=PROMPTS,
                   max_new_tokens=STEPS, fusions=fusions, model_options=TP1)
    results = get_pool(tp).run(run_rank, spec)
    # the world-1 run of the sharded layout: the same numbers, however the experts are run
    assert_matches_world1(replace(spec, model_options=()), results)
    layers = load_config(ds_dir).num_hidden_layers
    for r in results:
        for step in range(STEPS):
            sums = sums_of_ffn_outputs(r.ledger, layers, step)
            assert all(len(s) == 1 for s in sums.values()), (r.rank, step, sums)
        moe_exits = [row["exit"] for row in r.plan if row["stage"].endswith("ffn")][1:]
        if policy == "ar" and fusions is None:  # LOCAL_TAIL: never deferred without a provider
            assert all("in compute" in e for e in moe_exits), moe_exits
