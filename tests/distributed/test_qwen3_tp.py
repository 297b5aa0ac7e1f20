"""Qwen3 under tensor parallelism on real gloo ranks against the world-1 run."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
from checkpoints import hf_qwen3

from layer_boundary.engine.runner import RunSpec, merge, run_rank

from .checks import assert_logits_match
from .pool import get_pool

PROMPTS = ((1, 2, 3, 4, 5), (7, 8, 9), (50, 3, 17, 88, 2, 61, 33))
STEPS = 3  # step 0 is the prefill, the rest are KV-cache decode steps


@functools.cache
def world1(spec: RunSpec):
    return merge([run_rank(replace(spec, tp=1, dp=1), world_size=1)])


def assert_parity(spec: RunSpec, results) -> None:
    ref = world1(replace(spec, boundary_reduction="ar", allreduce_fusion=True))
    assert_logits_match(merge(results), ref, len(spec.prompts))
    assert all(r.streams_released for r in results), "a forward left its residual stream open"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("policy", ["ar", "auto"])
@pytest.mark.parametrize("allreduce_fusion", [True, False], ids=["deferred", "in-compute"])
def test_tp_matches_world1(qwen3_dir, tp, policy, allreduce_fusion):
    spec = RunSpec(str(qwen3_dir), tp=tp, boundary_reduction=policy, prompts=PROMPTS,
                   max_new_tokens=STEPS, allreduce_fusion=allreduce_fusion)
    assert_parity(spec, get_pool(tp).run(run_rank, spec))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp", [2, 4])
def test_tied_embeddings_and_padded_vocab_match_world1(tmp_path_factory, tp):
    # vocab 97 is not a multiple of tp: the vocab-parallel embedding and LM head pad it
    path = hf_qwen3(tmp_path_factory.mktemp("tied97"), seed=3, tie=True, vocab_size=97)
    spec = RunSpec(str(path), tp=tp, prompts=PROMPTS, max_new_tokens=STEPS)
    assert_parity(spec, get_pool(tp).run(run_rank, spec))
