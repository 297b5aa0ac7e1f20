"""``moe_a2a_backend="all_to_all"`` in the five MoE models, on gloo ranks against world 1 (which
matches transformers: the oracle tests), prefill and decode.

The MoE stays on the attention rows (local under ar with attention TP 1, scattered under
rs/rsv) and dispatches each routed token itself. Checked per run: tokens and logits, that no
MoE stage's prepare gathers (the hidden-width gather the backend removes) and that each MoE
layer's compute ran its four all-to-alls (counts, rows, ids and weights, combine) per forward;
an empty DP rank, two-batch overlap and a pipeline. The element counts of each all-to-all
against the routing are ``tests/models/test_moe_dispatch.py``'s.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from checkpoints.ds import hf_deepseek_v3
from checkpoints.ds4 import hf_deepseek_v4
from checkpoints.lc import hf_longcat_flash
from checkpoints.nh import hf_nemotron_h

from layer_boundary.adapters.tbo import TboPolicy
from layer_boundary.engine.runner import RunSpec, merge, run_rank

from .checks import assert_logits_match, cli_ok, world1
from .pool import get_pool

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2), (4, 4, 1))
STEPS = 2


@pytest.fixture(scope="module")
def dirs(qwen3_moe_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe_a2a")
    return {"qwen3_moe": str(qwen3_moe_dir),
            "deepseek_v3": str(hf_deepseek_v3(root / "deepseek_v3")),
            "longcat_flash": str(hf_longcat_flash(root / "longcat_flash")),
            "deepseek_v4": str(hf_deepseek_v4(root / "deepseek_v4")),
            "nemotron_h": str(hf_nemotron_h(root / "nemotron_h"))}


def check_run(spec: RunSpec) -> list:
    """The run's ranks, after its tokens, logits and MoE ledger are checked."""
    results = get_pool(spec.world_size).run(run_rank, spec)
    assert_logits_match(merge(results), world1(replace(spec, moe_a2a_backend="none",
                                                       tbo=TboPolicy.OFF,
                                                       pp=1)), len(spec.prompts))
    for r in results:
        assert r.streams_released
        moe = {row["stage"] for row in r.plan if "all-to-all dispatch" in row["kind"]}
        assert moe, r.plan
        for step in range(STEPS):  # the prefill, then a decode step
            for stage in moe:
                sites = [(e.site, e.kind) for e in r.ledger if e.step == step
                         and e.site.startswith(f"{stage}.")]
                assert (f"{stage}.prepare", "all_gather") not in sites, (stage, sites)
                a2a = sites.count((f"{stage}.compute", "all_to_all"))
                assert a2a == 4 * (2 if spec.tbo is TboPolicy.ALWAYS else 1), (stage, step, sites)
    return results


# (tp, attn_dp, ep, policy, prompts): attention TP 1 (every row mode), attention TP 2 under
# rs and rsv, an empty DP rank, moe_tp 2
CASES = [(4, 4, 4, "ar", PROMPTS), (4, 4, 4, "rsv", PROMPTS), (4, 2, 4, "rs", PROMPTS),
         (4, 2, 4, "rsv", PROMPTS), (4, 2, 4, "rsv", PROMPTS[:1]), (4, 2, 2, "rs", PROMPTS[:3])]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,ep,policy,prompts", CASES, ids=[
    f"tp{t}-dp{d}-ep{e}-{p}-{len(n)}" for t, d, e, p, n in CASES])
@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3", "longcat_flash", "deepseek_v4",
                                   "nemotron_h"])
def test_all_to_all_moe_matches_world1(dirs, model, tp, dp, ep, policy, prompts):
    check_run(RunSpec(dirs[model], tp=tp, dp=dp, ep=ep, boundary_reduction=policy,
                      prompts=prompts, max_new_tokens=STEPS, moe_a2a_backend="all_to_all"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model,options", [("deepseek_v3", {"tbo": TboPolicy.ALWAYS}),
                                           ("qwen3_moe", {"pp": 2})], ids=["tbo", "pp2"])
def test_all_to_all_moe_with_tbo_and_pp(dirs, model, options):
    tp, dp = (4, 2) if "tbo" in options else (2, 1)
    check_run(RunSpec(dirs[model], tp=tp, dp=dp, ep=tp, boundary_reduction="rsv" if dp > 1
                      else "rs", prompts=PROMPTS, max_new_tokens=STEPS,
                      moe_a2a_backend="all_to_all", **options))


@pytest.mark.timeout(300)
def test_cli_run_passes_parity(dirs, capsys, restore_logger):
    out = cli_ok(["run", "--model", dirs["deepseek_v3"], "--tp", "4", "--dp", "2", "--ep", "4",
                  "--moe-a2a-backend", "all_to_all", "--max-new-tokens", "2"], capsys)
    assert "MoE all_to_all dispatch" in out and "parity vs world 1: PASS" in out
    assert "all_to_all:" in out  # the collectives summary counts them
