"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE under TP, attention DP and expert parallelism on gloo
ranks against world 1: gated DeltaNet heads over attention TP (one key head per rank at
attention TP 4), gated-attention heads over attention TP (kv heads replicated at 4), routed
experts over moe_ep x moe_tp with the gated shared expert's partial in their sum; a prefill,
then recurrent / KV-cache decode steps; the `run` command's parity check."""

from __future__ import annotations

from dataclasses import replace

import pytest
from checkpoints.qwen3_next import hf_qwen3_next

from layer_boundary.models import load_config
from layer_boundary.engine.runner import RunSpec, merge, run_rank

from .checks import assert_logits_match, cli_ok, sums_of_ffn_outputs, world1
from .pool import get_pool

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))  # dp=4 leaves a rank idle
STEPS = 3  # a prefill, then two cached decode steps

# (model, tp, attn_dp, moe_ep, policy, expected row mode of the prefill): each model at tp 2
# and at tp 4 dp 2 in rs, rsv and auto (which chooses per batch: rsv for this skewed prefill),
# the MoE models with expert parallelism
CASES = [
    ("qwen3_next", 2, 1, 1, "ar", "ar"),
    ("qwen3_next", 4, 2, 2, "rs", "rs"),  # attention TP 2 under DP 2, moe_tp 2
    ("qwen3_next", 4, 2, 2, "rsv", "rsv"),
    ("qwen3_next", 4, 2, 4, "auto", "rsv"),  # pure EP
    ("qwen3_5", 2, 1, 1, "rs", "rs"),
    ("qwen3_5", 4, 1, 1, "ar", "ar"),  # attention TP 4: one key head per rank
    ("qwen3_5", 4, 2, 1, "rs", "rs"),
    ("qwen3_5", 4, 2, 1, "rsv", "rsv"),
    ("qwen3_5", 4, 2, 1, "auto", "rsv"),
    ("qwen3_5_moe", 2, 1, 2, "ar", "ar"),
    ("qwen3_5_moe", 4, 2, 2, "rs", "rs"),
    ("qwen3_5_moe", 4, 2, 4, "auto", "rsv"),
    ("qwen3_5_moe", 4, 4, 2, "rs+rsv", "rsv"),  # attention DP 4 with an empty DP rank
]


def logit_tolerance(ref) -> float:
    """1e-5 times the logit scale: a random DeltaNet amplifies fp32 rounding (see
    tests/models/test_qwen3_next_oracle.py), and rank sums round in another order."""
    return 1e-5 * max(1.0, max(t.abs().max().item() for steps in ref.logits for t in steps))


def run_matching_world1(spec: RunSpec, mode: str) -> list:
    """checks.run_matching_world1 at ``logit_tolerance``."""
    results = get_pool(spec.world_size).run(run_rank, spec)
    ref = world1(spec)
    assert_logits_match(merge(results), ref, len(spec.prompts), logit_tolerance(ref))
    for r in results:
        assert r.modes[0] == mode, (r.rank, r.modes)
        assert r.streams_released
        if r.dp_rank >= len(spec.prompts):
            assert r.generation.request_ids == [], r.rank
    return results


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("qwen3_next")
    return {arch: str(hf_qwen3_next(root / arch, arch, seed=i))
            for i, arch in enumerate(("qwen3_next", "qwen3_5", "qwen3_5_moe"))}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model,tp,dp,ep,policy,mode", CASES,
                         ids=[f"{c[0]}-tp{c[1]}-dp{c[2]}-ep{c[3]}-{c[4]}" for c in CASES])
def test_matches_world1(dirs, model, tp, dp, ep, policy, mode):
    run_matching_world1(RunSpec(dirs[model], tp=tp, dp=dp, ep=ep, boundary_reduction=policy,
                                prompts=PROMPTS, max_new_tokens=STEPS), mode)


@pytest.mark.timeout(240)
def test_all_to_all_moe_matches_world1(dirs):
    """The MoE dispatches its routed tokens, the shared expert whole beside them."""
    spec = RunSpec(dirs["qwen3_5_moe"], tp=4, dp=2, ep=4, boundary_reduction="rsv",
                   prompts=PROMPTS, max_new_tokens=STEPS, moe_a2a_backend="all_to_all")
    results = get_pool(spec.world_size).run(run_rank, spec)
    ref = world1(replace(spec, moe_a2a_backend="none"))
    assert_logits_match(merge(results), ref, len(PROMPTS), logit_tolerance(ref))
    assert all(any("all-to-all dispatch" in row["kind"] for row in r.plan) for r in results)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model,args", [("qwen3_next", ["--tp", "2"]),
                                        ("qwen3_5", ["--tp", "2"]),
                                        ("qwen3_5_moe", ["--tp", "4", "--dp", "2", "--ep", "2"])])
def test_run_command_passes_parity(dirs, capsys, restore_logger, model, args):
    out = cli_ok(["run", "--model", dirs[model], *args, "--max-new-tokens", "2"], capsys)
    assert "parity vs world 1: PASS" in out
    assert "asked auto, by architectures: " in out


# (tp, attn_dp, policy, fused): attention DP leaves the handoff on every DP rank's rows (dp 4
# has an idle DP rank), rs and rsv keep the residual scattered: the norm completes it unfused
TERMINAL_CASES = [(2, 1, "ar", True), (4, 1, "ar", True), (4, 4, "ar", False),
                  (4, 2, "rs", False), (4, 2, "rsv", False)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,policy,fused", TERMINAL_CASES,
                         ids=[f"tp{t}-dp{d}-{p}" for t, d, p, _ in TERMINAL_CASES])
def test_terminal_finalize_in_the_final_norm(dirs, tp, dp, policy, fused):
    """The reference provider installed with terminal_finalize: Qwen3.5-MoE's last MoE hands
    its finalize to the zero-centered final norm. On ar its service finalizes, all-reduces,
    adds and norms in one call (the ledger's one sum of that FFN per forward is the service's,
    at ``final_norm.fused``); where the residual is scattered, or attention DP would need a
    slice of the sum, it is not asked and the norm completes the handoff unfused (by
    reduce-scatter, or all-reduce and slice). All match world 1 (unfused)."""
    spec = RunSpec(dirs["qwen3_5_moe"], tp=tp, dp=dp, ep=2, boundary_reduction=policy,
                   prompts=PROMPTS, max_new_tokens=STEPS, fusions="reference-terminal")
    layers = load_config(dirs["qwen3_5_moe"]).num_hidden_layers
    for r in run_matching_world1(spec, policy):
        for step in range(STEPS):
            last = sums_of_ffn_outputs(r.ledger, layers, step)[layers - 1]
            unfused = "all_reduce" if policy == "ar" else "reduce_scatter"
            assert last == ([("all_reduce", "final_norm.fused")] if fused
                            else [(unfused, "final_norm")]), (r.rank, step, last)
        assert r.fused_final_norms == (STEPS if fused else 0)
