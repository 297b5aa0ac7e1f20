"""OLMo-2 with its post norms as after-sum ``OutputTransform``s (``tests/olmo_like.py``) at
world 1: transformers' ``Olmo2ForCausalLM`` on the same checkpoint, and bit for bit the model
file's post-norm residual kind; and what its layer stack holds: a transform object per layer,
neighbours that agree by what they do."""

from __future__ import annotations

import re

import pytest
import torch
from checkpoints import hf_oracle
from checkpoints.olmo import hf_olmo2
from olmo_like import OlmoLikeLayer, load_olmo_like

from layer_boundary.models import load_model, open_checkpoint
from layer_boundary.runtime import (BoundaryRuntime, ForwardBatch, ForwardMode, ParallelDims,
                                    build_parallel)

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [35, 8], [9, 7, 9, 3, 2]]


@pytest.fixture(scope="module")
def olmo_dir(tmp_path_factory):
    return hf_olmo2(tmp_path_factory.mktemp("olmo2"))


def world1():
    return BoundaryRuntime(build_parallel(ParallelDims()))


def prefill(model):
    with torch.no_grad():
        return model(ForwardBatch.build(ForwardMode.EXTEND, PROMPTS, [0] * len(PROMPTS),
                                        kv_cache=model.make_kv_cache(len(PROMPTS), 16)))


def test_world1_matches_transformers_and_the_post_norm_kind(olmo_dir):
    logits = prefill(load_olmo_like(olmo_dir, world1()))
    ref = hf_oracle("Olmo2ForCausalLM", olmo_dir)
    start = 0
    for j, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0]
        diff = (logits[start:start + len(prompt)] - expected).abs().max().item()
        assert diff <= 1e-5, f"request {j}: max abs diff {diff}"
        start += len(prompt)
    assert torch.equal(logits, prefill(load_model(olmo_dir, world1())))


def test_each_layer_holds_its_own_transform_and_neighbours_agree(olmo_dir):
    """Every stage's transform is its own layer's post-norm (its own weights); the stack took
    the neighbours all the same, and the declaration a neighbour rebuilds without the layer
    describes the stage as built. None of them is portable: each holds a layer's weights."""
    model = load_olmo_like(olmo_dir, world1())
    cfg = open_checkpoint(olmo_dir).config
    stages = model.stack.stages
    transforms = [s.declaration.output_transform for s in stages]
    assert len({id(t) for t in transforms}) == len(stages) == 2 * cfg.num_hidden_layers
    for i, layer in enumerate(model.model.layers):
        assert layer.ffn_boundary.declaration.output_transform.fn is \
            layer.post_feedforward_layernorm
        rebuilt = OlmoLikeLayer.declarations(cfg, i, model.stack.runtime)
        for decl, built in zip(rebuilt, (layer.attn_boundary, layer.ffn_boundary)):
            assert decl.facts() == built.declaration.facts()
            assert decl.residual.update == built.declaration.residual.update
            assert not built.declaration.residual.update.portable
    for before, after in zip(stages, stages[1:]):
        assert after.declaration.previous.facts() == before.declaration.facts()


@pytest.mark.parametrize("route", ["transform", "post-norm kind"])
def test_the_paths_table_says_how_the_residual_is_read(olmo_dir, route):
    """A stage without a norm of its own (nn.Identity) reads by its producer's update alone
    (neither is the plain add); the transform route's exits name the post norm that runs
    after the sum."""
    from layer_boundary.engine.describe import plan_rows

    model = (load_olmo_like if route == "transform" else load_model)(olmo_dir, world1())
    rows = plan_rows(model)
    later = [row for row in rows if row["stage"] != "layer0.attn"]  # the entry reads no sum
    assert later and all(row["entry"].startswith("update on ") for row in later), later
    if route == "transform":
        assert all(re.match(r"layer\d+\.post_\w+_layernorm after the sum; ", row["exit"])
                   for row in rows), rows
