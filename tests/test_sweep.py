"""``layer-boundary sweep``: every layout the capability check accepts, run against one
world-1 run, in one table (one JSON row a layout); refused layouts counted, not run."""

from __future__ import annotations

import json

import pytest
from distributed.checks import cli

from layer_boundary.engine.run_command import DEFAULT_PROMPTS
from layer_boundary.engine.sweep import Layout, layouts, sweep

pytestmark = pytest.mark.usefixtures("restore_logger")


def test_the_layouts_cover_every_parallelism_up_to_the_world():
    dense = layouts(4, moe=False, layers=3)
    assert len(set(dense)) == len(dense)
    names = {layout.name() for layout in dense}
    for expected in ("tp1 auto", "tp2 rsv", "tp4 dp2 empty-dp rsv", "tp2 cp2 rs",
                     "tp2 sp rsv", "tp2 pp2 ar", "tp1 pp2 auto", "tp4 dp4 auto"):
        assert expected in names, expected
    assert not any(layout.ep > 1 or layout.a2a for layout in dense)
    assert max(layout.world for layout in dense) == 4
    moe = layouts(4, moe=True, layers=3)
    assert {"tp4 ep4 a2a rsv", "tp4 dp2 ep4 a2a empty-dp rsv", "tp2 ep2 ar"} <= {
        layout.name() for layout in moe}
    assert all(layout.pp <= 3 for layout in layouts(8, moe=False, layers=3))


def test_a_sweep_runs_what_is_accepted_and_counts_what_is_refused(qwen3_moe_dir):
    candidates = [Layout(1), Layout(2, policy="rsv"), Layout(2, dp=2, policy="rsv", empty=True),
                  Layout(2, ep=2, a2a=True, policy="rs"), Layout(2, pp=2, dp=2),
                  Layout(4, cp=2, ep=2, a2a=True)]  # CP with the all-to-all MoE: refused
    result = sweep(str(qwen3_moe_dir), 4, None, 2, DEFAULT_PROMPTS, candidates=candidates)
    rows = {r["layout"]: r for r in result["rows"]}
    assert list(rows) == ["tp1 auto", "tp2 rsv", "tp2 dp2 empty-dp rsv", "tp2 ep2 a2a rs",
                          "tp2 dp2 pp2 auto"]
    for row in rows.values():
        assert row["verdict"] == "PASS", row
        assert row["exactly_once"] == "PASS"
    assert rows["tp1 auto"]["max_abs_diff"] == 0.0 and rows["tp1 auto"]["bytes"] == 0
    assert rows["tp2 rsv"]["bytes"] > 0 and rows["tp2 rsv"]["bytes_over_min"] == 1.0
    refused = {r["layout"]: r["why"] for r in result["refused"]}
    assert "tp4 cp2 ep2 a2a auto" in refused
    assert result["passed"] == result["run"] == len(rows)


def test_the_command_prints_one_json_row_a_layout(capsys):
    code, out = cli(["sweep", "--max-world", "1", "--json"], capsys)
    assert code == 0
    result = json.loads(out)
    assert [r["layout"] for r in result["rows"]] == ["tp1 auto"]
    assert result["rows"][0]["verdict"] == "PASS"


def test_token_ids_outside_the_vocabulary_are_refused_as_run_refuses_them(qwen3_dir, capsys,
                                                                           restore_logger):
    """The sweep took a user's ids modulo the vocabulary and passed every layout on prompts
    run refuses; its defaults still are (they are the package's, not the user's)."""
    from layer_boundary.engine.cli import main

    assert main(["sweep", "--model", str(qwen3_dir), "--prompt-ids", "1,999"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "layer-boundary: error: prompt 0 has token ids [999] outside vocab_size=96"]
