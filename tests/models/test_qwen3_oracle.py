"""World 1 against transformers: the oracle every multi-rank run is compared back to."""

from __future__ import annotations

import pytest
import torch
from checkpoints import hf_qwen3, hf_reference

from layer_boundary.models import load_model
from layer_boundary.engine.generate import greedy_generate
from layer_boundary.models.tiny import write_tiny_qwen3
from layer_boundary.runtime.args import BoundaryRuntime
from layer_boundary.runtime.parallel import ParallelDims, build_parallel

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 88, 2, 61, 33]]
STEPS = 4


def world1():
    return BoundaryRuntime(build_parallel(ParallelDims()))


def assert_matches_hf(path, prompts=PROMPTS, steps=STEPS):
    ours = load_model(path, world1())
    ref = hf_reference(path)
    gen = greedy_generate(ours, prompts, steps)
    for j, prompt in enumerate(prompts):
        # the full sequence through transformers: position p's logits predict token p+1
        ids = torch.tensor([prompt + gen.generated[j][:-1]])
        with torch.no_grad():
            expected = ref(ids).logits[0]
        for step in range(steps):
            pos = len(prompt) - 1 + step
            diff = (expected[pos] - gen.logits[j][step]).abs().max().item()
            assert diff <= 1e-5, f"prompt {j} step {step}: max abs diff {diff}"
        # greedy tokens agree with the oracle's own argmax along the sequence
        assert gen.generated[j] == expected[len(prompt) - 1:].argmax(-1).tolist()


@pytest.mark.parametrize("tie,rope_theta", [(False, 1e4), (True, 1e6), (False, 1e6), (True, 1e4)])
def test_world1_matches_transformers_prefill_and_decode(tmp_path, tie, rope_theta):
    assert_matches_hf(hf_qwen3(tmp_path, tie=tie, rope_theta=rope_theta))


def test_world1_matches_transformers_mha_with_attention_bias(tmp_path):
    path = hf_qwen3(tmp_path, num_key_value_heads=8, attention_bias=True)
    assert_matches_hf(path)


def test_builtin_checkpoint_loads_in_transformers(tmp_path):
    assert_matches_hf(write_tiny_qwen3(tmp_path / "tiny"))


def test_decode_continues_the_cached_prefix_not_a_fresh_sequence(tmp_path):
    """Decode logits must depend on the cached prefix: compare with a cache-less rerun."""
    path = hf_qwen3(tmp_path)
    ours = load_model(path, world1())
    gen = greedy_generate(ours, [[5, 6, 7]], 2)
    alone = greedy_generate(ours, [[gen.generated[0][0]]], 1)
    assert (gen.logits[0][1] - alone.logits[0][0]).abs().max() > 1e-3
