"""``--sequence-parallel`` and ``--attn-input-scattered`` on ``plan`` and ``run``: the
variant's paths as ``plan`` shows them, and the refusals (a model whose compute cannot honour
the variant, the ar policy), each a one-line error before any rank starts (the features they
do not combine with: ``tests/test_combinations.py``)."""

from __future__ import annotations

import json

import pytest
from checkpoints.ds import hf_deepseek_v3
from checkpoints.nh import hf_nemotron_h

from distributed.checks import cli_ok
from layer_boundary.engine.cli import main


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("layer-boundary: error:"), err
    return lines[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("variant_cli")
    return {"deepseek_v3": str(hf_deepseek_v3(root / "deepseek_v3")),
            "nemotron_h": str(hf_nemotron_h(root / "nemotron_h"))}


@pytest.mark.parametrize("tp,dp,tokens,mode", [("2", "1", "5", "rsv"), ("4", "2", "5,0", "rsv")])
def test_plan_shows_the_sequence_parallel_paths(qwen3_dir, tp, dp, tokens, mode, capsys,
                                                restore_logger):
    args = ["plan", "--model", str(qwen3_dir), "--tp", tp, "--dp", dp, "--tokens", tokens,
            "--sequence-parallel"]
    plan = json.loads(cli_ok([*args, "--json"], capsys))
    assert plan["variant"] == "sequence-parallel" and plan["mode"] == mode
    # every stage computes on the scattered rows; its linears gather in and scatter out
    for stage in plan["stages"]:
        # without attention DP the FFN's gather is the attention-TP one (the same ranks)
        gather, scatter = (("attn_tp", "attn_tp") if stage["stage"].endswith("attn")
                           else ("attn_tp" if dp == "1" else "tp", "tp"))
        assert stage["compute"] == stage["residual"], stage
        assert stage["exit"] == (f"sequence-parallel compute: all_gather_v({gather}) in, "
                                 f"reduce_scatter_v({scatter}) out"), stage
    ordinary = json.loads(cli_ok([*args[:-1], "--json"], capsys))
    assert ordinary["variant"] == "ordinary" and all(
        "sequence-parallel" not in s["exit"] for s in ordinary["stages"])
    assert "a sequence-parallel batch" in cli_ok(args, capsys)


def test_plan_shows_the_latent_before_the_gather(models, capsys, restore_logger):
    args = ["plan", "--model", models["deepseek_v3"], "--tp", "2", "--dp", "1",
            "--boundary-reduction", "rs", "--tokens", "5"]
    scattered = json.loads(cli_ok([*args, "--attn-input-scattered", "--json"], capsys))
    ordinary = json.loads(cli_ok([*args, "--json"], capsys))
    assert scattered["variant"] == "input-scattered" and ordinary["variant"] == "ordinary"
    attn = [i for i, s in enumerate(ordinary["stages"])
            if s["stage"].endswith("attn") and s["stage"] != "layer0.attn"]
    assert attn
    for i in attn:
        assert ordinary["stages"][i]["entry"].endswith("all_gather(attn_tp) -> qkv_latent_func")
        assert scattered["stages"][i]["entry"].endswith("qkv_latent_func -> all_gather(attn_tp)")
    assert "an input-scattered batch" in cli_ok([*args, "--attn-input-scattered"], capsys)


@pytest.mark.parametrize("command", ["run", "plan"])
@pytest.mark.parametrize("model,flag,why", [
    ("qwen3", "--attn-input-scattered", "qwen3 cannot run input-scattered attention: its "
                                        "attention has no qkv latent to run before the gather"),
    ("deepseek_v3", "--sequence-parallel", "deepseek_v3 cannot run sequence parallelism: its "
                                           "MLA latent projections are replicated"),
    ("nemotron_h", "--sequence-parallel", "nemotron_h cannot run sequence parallelism: its "
                                          "Mamba2 mixers consume their own rows")])
def test_a_model_that_cannot_run_the_variant_is_refused_by_name(qwen3_dir, models, model, flag,
                                                                why, command, capsys,
                                                                restore_logger):
    path = str(qwen3_dir) if model == "qwen3" else models[model]
    assert main([command, "--model", path, flag, "--tp", "2", "--dp", "1",
                 "--boundary-reduction", "rs"]) == 2
    assert why in _one_line_error(capsys.readouterr().err)


# the variants against every other feature: tests/test_combinations.py walks every pair
@pytest.mark.parametrize("args,message", [
    (["--sequence-parallel", "--boundary-reduction", "ar"],
     "--sequence-parallel needs a scattered residual: --boundary-reduction ar "
     "(BoundaryRuntime.boundary_reduction) permits no reduce-scatter (use rs, rsv or rs+rsv)")])
def test_a_variant_with_the_ar_policy_is_a_one_line_error(args, message, capsys,
                                                          restore_logger):
    assert main(["run", "--tp", "2", "--dp", "1", *args]) == 2
    assert message in _one_line_error(capsys.readouterr().err)
