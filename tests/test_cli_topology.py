"""``plan`` and ``run`` derive one topology from the same flags, and ``run`` says how many
processes it starts before it starts them."""

from __future__ import annotations

import json

import pytest

from distributed.checks import cli_ok
from layer_boundary.engine.args import build_parser
from layer_boundary.engine.run_command import spec_from_args


@pytest.mark.parametrize("flags", [[], ["--tp", "2"], ["--tp", "4"], ["--dp", "4"],
                                   ["--tp", "4", "--dp", "2"], ["--tp", "2", "--pp", "2"]])
def test_plan_and_run_report_the_same_topology(flags, capsys, restore_logger):
    spec = spec_from_args(build_parser().parse_args(["run", *flags]))
    plan = json.loads(cli_ok(["plan", *flags, "--json"], capsys))
    assert (plan["tp"], plan["dp"], plan.get("pp", 1)) == (spec.tp, spec.dp, spec.pp), flags


def test_run_says_how_many_processes_it_starts(capsys, restore_logger):
    out = cli_ok(["run", "--pp", "2", "--tp", "1", "--max-new-tokens", "1"], capsys)
    assert out.splitlines()[0] == "starting 2 rank processes (pp 2 x tp 1)"


def test_the_plan_explains_its_notation(capsys, restore_logger):
    from layer_boundary.engine.plan_command import PLAN_LEGEND

    out = cli_ok(["plan", "--tp", "4", "--dp", "2"], capsys)
    lines = out.splitlines()
    start = lines.index("legend:")
    assert lines[start:start + len(PLAN_LEGEND)] == list(PLAN_LEGEND)
    # every term the legend explains appears in the plan above it
    table = "\n".join(lines[:start])
    for term in ("attn_tp_scatter", "attn_dp", "partial: attn_tp sum owed", "all_gather_v"):
        assert term in table, term
