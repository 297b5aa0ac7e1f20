"""Every reference model's layer stack knows its neighbours across a pipeline cut.

Each pipeline rank builds only its own layers, so the stage before its first (on the rank
before) and the stage after its last (on the rank after) are declarations the rank derives
from the layers' own declaration function. Built from construction alone (meta device, a
virtual rank's view of the topology, as ``layer-boundary plan`` builds them), every stage of
every pipeline rank has the plan the same stage has when one rank holds the whole stack (same
tensor parallelism), and the two sides of each cut describe each other as they are. A rank
whose stack started at its first layer (previous=None), or ended at its last (terminal),
fails here: its plans enter or leave the model's stack mid-pipeline.
"""

from __future__ import annotations

import pytest
from distributed.checks import cli_ok
from model_configs import CONFIGS, build, config

from layer_boundary.layout import RowMode

def plans(model) -> dict:
    """Each stage's paths in every row mode, by stage name."""
    return {s.name: [s.describe(mode) for mode in (RowMode.AR, RowMode.RS, RowMode.RSV)]
            for s in model.stack.stages}


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_each_pipeline_rank_builds_the_plans_of_the_whole_stack(model_type):
    model_cls, cfg = config(model_type)
    (whole,) = build(model_cls, cfg, tp=2, pp=1)
    expected = plans(whole)
    for pp in (2, 3):
        ranks = build(model_cls, cfg, tp=2, pp=pp)
        seen = {}
        for rank, model in enumerate(ranks):
            for name, paths in plans(model).items():
                assert paths == expected[name], f"pp {pp} rank {rank}, stage {name}"
                seen[name] = rank
        assert sorted(seen) == sorted(expected)
        for before, after in zip(ranks, ranks[1:]):
            last, first = before.stack.last, after.stack.first
            # each side of the cut describes the other by what it does
            assert first.declaration.previous.facts() == last.declaration.facts(), first.name
            assert last.following.facts() == first.declaration.facts(), last.name
            assert not last.declaration.terminal
        assert ranks[-1].stack.last.declaration.terminal


def test_plan_shows_a_pipeline_as_the_whole_stack(capsys, restore_logger):
    """``layer-boundary plan --pp 2``: every stage of either pipeline stage has the path it
    has without a pipeline, and the handoff is the one its receiver's declaration expects."""
    import json

    whole = json.loads(cli_ok(["plan", "--tp", "2", "--json"], capsys))
    cut = json.loads(cli_ok(["plan", "--tp", "2", "--pp", "2", "--json"], capsys))
    rows = {row["stage"]: row for row in whole["stages"]}
    for row in cut["stages"]:
        stage = row.pop("pp_stage")
        assert row == rows[row["stage"]], (stage, row["stage"])
    assert "layer2.attn.from_pp()" in cut["pipeline"][0]["handoff"]
