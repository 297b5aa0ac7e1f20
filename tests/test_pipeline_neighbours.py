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
import torch
from checkpoints import TINY, TINY_MOE
from distributed.checks import cli_ok
from ds4_checkpoints import TINY_DS4
from ds_checkpoints import TINY_DS
from lc_checkpoints import TINY_LC
from nh_checkpoints import TINY_NH
from qwen3_next_checkpoints import TINY_35, TINY_35_MOE, TINY_NEXT

from layer_boundary.layout import RowMode
from layer_boundary.models.registry import model_class
from layer_boundary.runtime import BoundaryRuntime, ParallelDims
from layer_boundary.runtime.parallel import virtual_parallel

# model_type -> (transformers config class, its fields): the cuts fall between every kind of
# neighbour (dense and sparse FFNs, a mixer before an FFN, a branch's merged output)
CONFIGS = {
    "qwen3": ("Qwen3Config", dict(TINY, num_hidden_layers=4)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(TINY_MOE, num_hidden_layers=4, mlp_only_layers=[0, 2])),
    "llama": ("LlamaConfig", dict(TINY, num_hidden_layers=4)),
    "deepseek_v3": ("DeepseekV3Config", dict(TINY_DS, num_hidden_layers=4,
                                             first_k_dense_replace=2)),
    "deepseek_v4": ("DeepseekV4Config", dict(TINY_DS4, num_hidden_layers=4,
                                             layer_types=["sliding_attention"] * 4,
                                             mlp_layer_types=["hash_moe", "moe"] * 2)),
    "longcat_flash": ("LongcatFlashConfig", dict(TINY_LC, num_layers=4)),
    "nemotron_h": ("NemotronHConfig", TINY_NH),  # 8 blocks: pp 2 cuts after the attention
    "qwen3_next": ("Qwen3NextConfig", TINY_NEXT),
    "qwen3_5_text": ("Qwen3_5TextConfig", TINY_35),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", TINY_35_MOE),
}


def config(model_type: str):
    import transformers

    cls_name, fields = CONFIGS[model_type]
    raw = getattr(transformers, cls_name)(**fields).to_dict()
    model_cls = model_class(raw["model_type"])
    model_cls.config_class.validate(raw)
    return model_cls, model_cls.config_class.from_dict(raw)


def build(model_cls, cfg, tp: int, pp: int) -> list:
    """Each pipeline rank's model, as its first rank builds it."""
    dims = ParallelDims(world_size=pp * tp, tp=tp, pp=pp)
    models = []
    for stage in range(pp):
        runtime = BoundaryRuntime(virtual_parallel(dims, stage * tp), boundary_reduction="rs+rsv")
        with torch.device("meta"):  # boundaries are built at construction; no weights needed
            models.append(model_cls(cfg, runtime))
    return models


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
