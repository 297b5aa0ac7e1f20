"""Context parallelism in the reference models on gloo ranks, against world 1 (which matches
transformers: the oracle tests): each DP rank's tokens split over CP ranks by the CP mapping,
attention on the shares with the K/V (or the MLA latent) gathered over CP, the rest of the
layer on the shares; prefill, then decode steps (CP batches too: one-token requests on CP
rank 0). Prompts of different lengths, one shorter than 2 x cp, and a DP rank with none."""

from __future__ import annotations

import pytest
from checkpoints.ds import hf_deepseek_v3
from checkpoints.llama import hf_llama

from layer_boundary.models import load_config
from layer_boundary.ops import cp_share_sizes
from layer_boundary.engine.runner import RunSpec, run_rank
from layer_boundary.engine.runner import merge as merge_ranks

from .checks import assert_logits_match, cli_ok, world1
from .pool import get_pool

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))  # 9, 2 and 5 tokens
STEPS = 2

# (tp, attn_dp, attn_cp, moe_ep, policy): CP over attention TP 1 and 2, CP 4, CP with
# attention DP (a DP rank with two prompts, one with a two-token prompt), every row mode
TOPOLOGIES = [(2, 1, 2, 1, "auto"), (4, 2, 2, 2, "rsv"), (4, 1, 4, 2, "auto"),
              (4, 1, 2, 2, "ar"), (4, 1, 2, 1, "rs")]


@pytest.fixture(scope="module")
def dirs(qwen3_dir, qwen3_moe_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cp_models")
    return {"qwen3": str(qwen3_dir), "qwen3_moe": str(qwen3_moe_dir),
            "deepseek_v3": str(hf_deepseek_v3(root / "deepseek_v3")),
            "deepseek_v3_noqlora": str(hf_deepseek_v3(
                root / "deepseek_v3_noqlora", seed=2, q_lora_rank=None, rope_interleave=False)),
            "llama": str(hf_llama(root / "llama"))}


def dense(model: str) -> bool:
    return model in ("qwen3", "llama")


def cp_spec(path, model, tp, dp, cp, ep, policy, prompts=PROMPTS, **kw) -> RunSpec:
    return RunSpec(path, tp=tp, dp=dp, cp=cp, ep=1 if dense(model) else ep,
                   boundary_reduction=policy, prompts=prompts, max_new_tokens=STEPS, **kw)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,cp,ep,policy", TOPOLOGIES,
                         ids=[f"tp{t}-dp{d}-cp{c}-ep{e}-{p}" for t, d, c, e, p in TOPOLOGIES])
@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe", "deepseek_v3", "llama"])
def test_cp_matches_world1(dirs, model, tp, dp, cp, ep, policy):
    spec = cp_spec(dirs[model], model, tp, dp, cp, ep, policy)
    results = get_pool(tp).run(run_rank, spec)
    assert_logits_match(merge_ranks(results), world1(spec), len(PROMPTS))
    want = {"ar": "ar", "rs": "rs", "rsv": "rsv", "auto": "rsv"}[policy]
    for r in results:
        assert r.streams_released and r.modes == [want] * STEPS, (r.rank, r.modes)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model,fusions", [("qwen3_moe", "reference"),
                                           ("deepseek_v3", "reference-terminal"),
                                           ("deepseek_v3_noqlora", "reference")])
def test_cp_with_deferred_finalize_and_an_empty_dp_rank(dirs, model, fusions):
    """MoE finalize handoffs (a fusion provider) on CP shares, completed by the next input's
    built-in movement; one prompt under attention DP leaves DP rank 1 with no tokens (its CP
    ranks still join every movement). The provider's fused all-reduce + add + norm is not
    offered: under CP the sum lands on a share (all-reduce, then select), not on the rows it
    was summed on."""
    for tp, dp, cp, policy, prompts in ((4, 1, 2, "ar", PROMPTS),
                                        (4, 2, 2, "rs+rsv", PROMPTS[:1])):
        spec = cp_spec(dirs[model], model, tp, dp, cp, 2, policy, prompts, fusions=fusions)
        results = get_pool(tp).run(run_rank, spec)
        assert_logits_match(merge_ranks(results), world1(spec), len(prompts))
        for r in results:
            assert r.fused_inputs == 0 and r.fused_final_norms == 0
            assert not any("[fusable]" in row["entry"] for row in r.plan)
            assert any("finalize" in row["exit"] for row in r.plan)  # the handoff is a choice


def kv_width(model: str, cfg, attn_tp: int) -> int:
    """Elements per token of what attention gathers over CP: this rank's K and V heads, or
    DeepSeek-V3's compressed latent and its shared rope key (not the heads)."""
    if model.startswith("deepseek_v3"):
        return cfg.kv_lora_rank + cfg.qk_rope_head_dim
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * (cfg.num_key_value_heads // attn_tp) * head_dim


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", ["qwen3", "deepseek_v3"])
@pytest.mark.parametrize("tp,dp,cp", [(4, 1, 2), (4, 2, 2), (4, 1, 4)])
def test_cp_attention_gather_moves_what_the_mapping_implies(dirs, model, tp, dp, cp):
    """Per rank and layer, the prefill's K/V gather over CP carries every token of its DP
    rank once (each CP rank its share: the mapping's sizes), the width attention needs."""
    spec = cp_spec(dirs[model], model, tp, dp, cp, 1, "auto")
    cfg = load_config(dirs[model])
    attn_tp = tp // (dp * cp)
    lens = [[len(p) for p in PROMPTS[d::dp]] for d in range(dp)]  # prompt i on DP rank i % dp
    for r in get_pool(tp).run(run_rank, spec):
        shares = cp_share_sizes(lens[r.dp_rank], cp)
        gathers = [e for e in r.ledger if e.step == 0 and e.group == "attn_cp"
                   and e.site.endswith(".attn.compute")]
        assert len(gathers) == cfg.num_hidden_layers, (r.rank, gathers)
        for e in gathers:
            assert e.kind == "all_gather" and e.group_size == cp
            assert e.numel == sum(shares) * kv_width(model, cfg, attn_tp), (r.rank, e)
            assert e.bytes == (cp - 1) * e.numel * e.dtype.itemsize // cp


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags", [["--cp", "2", "--tp", "2"],
                                   ["--cp", "2", "--tp", "4", "--dp", "2",
                                    "--boundary-reduction", "rsv"],
                                   ["--cp", "4", "--tp", "4"]], ids=["cp2-tp2", "cp2-dp2", "cp4"])
def test_cli_cp_runs_pass_parity(dirs, flags, capsys, restore_logger):
    out = cli_ok(["run", "--model", dirs["qwen3_moe"], "--max-new-tokens", "2",
                  *[a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))], *flags],
                 capsys)
    assert "parity vs world 1: PASS" in out
    assert f"cp={flags[1]}" in out
