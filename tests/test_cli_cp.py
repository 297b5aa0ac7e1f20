"""``--cp`` on ``plan`` and ``run``: the CP rows per rank, and the refusals (a model whose
state cannot be cut over CP ranks, bad factors), each a one-line error before any rank starts
(the features CP does not combine with: ``tests/test_combinations.py``)."""

from __future__ import annotations

import json

import pytest
from checkpoints.ds4 import hf_deepseek_v4
from checkpoints.lc import hf_longcat_flash
from checkpoints.llama import hf_mistral
from checkpoints.nh import hf_nemotron_h

from distributed.checks import cli_ok
from layer_boundary.engine.cli import main
from layer_boundary.ops import cp_share_sizes


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("layer-boundary: error:"), err
    return lines[0]


def test_plan_shows_each_ranks_cp_rows(capsys, restore_logger):
    args = ["plan", "--cp", "2", "--tp", "4", "--dp", "2", "--tokens", "9,3"]
    plan = json.loads(cli_ok([*args, "--json"], capsys))
    assert plan["cp"] == 2 and plan["mode"] == "rsv"
    ranks = plan["ranks"]
    # ranks dp-major, then CP: each DP rank's tokens as one request, cut by the mapping
    assert [(r["dp_rank"], r["cp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["attention"] for r in ranks] == [*cp_share_sizes((9,), 2), *cp_share_sizes((3,), 2)]
    assert [r["local"] for r in ranks] == [9, 9, 3, 3]
    assert all(r["global"] == 12 for r in ranks)
    movements = {m["movement"] for m in plan["movements"]}
    assert {"all_gather_v(attn_cp)", "select(attn_cp)", "all_gather_v(dp_cp)",
            "reduce_scatter_v(tp)"} <= movements, movements

    text = cli_ok(args, capsys)
    assert "cp=2" in text and "rows per rank (local / attention / scattered / global)" in text
    assert "r0 9/5/5/12, r1 9/4/4/12, r2 3/1/1/12, r3 3/2/2/12" in text
    assert "CP rank r attends chunks r and 3-r" in text


@pytest.fixture(scope="module")
def refusing_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("no_cp")
    return {"nemotron_h": str(hf_nemotron_h(root / "nemotron_h")),
            "mistral": str(hf_mistral(root / "mistral")),
            "deepseek_v4": str(hf_deepseek_v4(root / "deepseek_v4")),
            "longcat_flash": str(hf_longcat_flash(root / "longcat_flash"))}


@pytest.mark.parametrize("model,why", [
    ("nemotron_h", "a Mamba2 state cannot be cut over CP ranks"),
    ("mistral", "its sliding window across a CP cut is not built"),
    ("deepseek_v4", "its sliding window and sinks across a CP cut are not built"),
    ("longcat_flash", "which takes ordinary token rows only")])
@pytest.mark.parametrize("command", ["run", "plan"])
def test_a_model_that_cannot_run_cp_is_refused_by_name(refusing_models, model, why, command,
                                                       capsys, restore_logger):
    assert main([command, "--model", refusing_models[model], "--cp", "2", "--tp", "2",
                 "--dp", "1"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert f"{model} cannot run context parallelism (attn_cp=2): " in line and why in line


# CP against every other feature: tests/test_combinations.py walks every pair
@pytest.mark.parametrize("args,message", [
    (["--tp", "4", "--dp", "4"], "tp 4 is not divisible by attn_dp 4 x attn_cp 2"),
    (["--tp", "3"], "tp 3 is not divisible by attn_dp 1 x attn_cp 2")])
def test_cp_on_a_topology_it_does_not_divide_is_a_one_line_error(args, message, capsys,
                                                                  restore_logger):
    base = ["run", "--cp", "2"] + ([] if "--tp" in args else ["--tp", "2"])
    assert main([*base, *args]) == 2
    assert message in _one_line_error(capsys.readouterr().err)
