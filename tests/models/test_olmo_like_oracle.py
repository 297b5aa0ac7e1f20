"""The OLMo-2-style test model (``tests/olmo_like.py``: each stage's contribution through its
layer's own post-norm, an after-sum ``OutputTransform``) at world 1 against transformers'
``Olmo2ForCausalLM`` on the same checkpoint, and what its layer stack holds: a transform
object per layer, neighbours that agree by what they do."""

from __future__ import annotations

import re

import pytest
import torch
from checkpoints import hf_oracle
from olmo_like import OlmoConfig, OlmoLayer, OlmoLike, hf_olmo2

from layer_boundary.runtime import (BoundaryRuntime, ForwardBatch, ForwardMode, ParallelDims,
                                    build_parallel)

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [35, 8], [9, 7, 9, 3, 2]]


@pytest.fixture(scope="module")
def olmo_dir(tmp_path_factory):
    return hf_olmo2(tmp_path_factory.mktemp("olmo2"))


def world1(path) -> OlmoLike:
    return OlmoLike(OlmoConfig.read(path), BoundaryRuntime(build_parallel(ParallelDims()))).load(
        path)


def test_world1_matches_transformers(olmo_dir):
    model = world1(olmo_dir)
    with torch.no_grad():
        logits = model(ForwardBatch.build(ForwardMode.EXTEND, PROMPTS, [0] * len(PROMPTS)))
    ref = hf_oracle("Olmo2ForCausalLM", olmo_dir)
    start = 0
    for j, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0]
        diff = (logits[start:start + len(prompt)] - expected).abs().max().item()
        assert diff <= 1e-5, f"request {j}: max abs diff {diff}"
        start += len(prompt)


def test_each_layer_holds_its_own_transform_and_neighbours_agree(olmo_dir):
    """Every stage's transform is its own layer's post-norm (its own weights); the stack took
    the neighbours all the same, and the declaration a neighbour rebuilds without the layer
    describes the stage as built. None of them is portable: each holds a layer's weights."""
    model = world1(olmo_dir)
    cfg = OlmoConfig.read(olmo_dir)
    stages = model.stack.stages
    transforms = [s.declaration.output_transform for s in stages]
    assert len({id(t) for t in transforms}) == len(stages) == 2 * cfg.num_hidden_layers
    for i, layer in enumerate(model.layers):
        assert layer.ffn_boundary.declaration.output_transform.fn is \
            layer.post_feedforward_layernorm
        rebuilt = OlmoLayer.declarations(cfg, i, model.stack.runtime)
        for decl, built in zip(rebuilt, (layer.attn_boundary, layer.ffn_boundary)):
            assert decl.facts() == built.declaration.facts()
            assert decl.residual.update == built.declaration.residual.update
            assert not built.declaration.residual.update.portable
    for before, after in zip(stages, stages[1:]):
        assert after.declaration.previous.facts() == before.declaration.facts()


def test_the_paths_table_says_add_and_names_the_transform(olmo_dir):
    """A stage without a norm of its own (nn.Identity) reads by an add alone, and its exit
    names the post-norm that runs on its contribution after the sum."""
    from layer_boundary.engine.describe import plan_rows

    rows = plan_rows(world1(olmo_dir))
    later = [row for row in rows if row["stage"] != "layer0.attn"]  # the entry reads no sum
    assert later and all(row["entry"].startswith("add on ") for row in later), later
    assert all(re.match(r"layer\d+\.post_\w+_layernorm after the sum; ", row["exit"])
               for row in rows), rows
