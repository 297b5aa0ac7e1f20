"""The Transformers backend (``models/generic``) on real gloo ranks against world 1: a Qwen2
(served by no file of ours) at tp 4 with attention DP 2 under rsv and a DP rank with no
request, and at pp 2 x tp 2; Llama, Qwen3, Mistral and Granite through the backend match our
own files at tp 2 within fp32 rounding."""

from __future__ import annotations

import pytest
from checkpoints.generic import hf_tiny

from layer_boundary.engine.runner import RunSpec, merge, run_rank
from layer_boundary.models.checkpoint import open_checkpoint

from .checks import assert_logits_match, run_matching_world1, world1
from .pool import get_pool

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))
STEPS = 3


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    folder = hf_tiny("qwen2", tmp_path_factory.mktemp("generic") / "qwen2", num_hidden_layers=4)
    return open_checkpoint(folder)  # auto: the backend (no qwen2 file of ours)


@pytest.mark.timeout(240)
def test_tp4_dp2_rsv_with_an_idle_dp_rank(qwen2):
    """One request on two DP ranks: DP rank 1 holds none, yet joins every collective."""
    assert qwen2.impl == "transformers"
    spec = RunSpec(qwen2.folder, checkpoint=qwen2, tp=4, dp=2, boundary_reduction="rsv",
                   prompts=PROMPTS[:1], max_new_tokens=STEPS)
    run_matching_world1(spec, "rsv")


@pytest.mark.timeout(240)
def test_pp2_tp2(qwen2):
    spec = RunSpec(qwen2.folder, checkpoint=qwen2, tp=2, pp=2, prompts=PROMPTS,
                   max_new_tokens=STEPS)
    results = get_pool(spec.world_size).run(run_rank, spec)
    assert_logits_match(merge(results), world1(spec), len(PROMPTS))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_type,fields", [
    ("llama", {}), ("qwen3", {}), ("mistral", {"sliding_window": 4}), ("granite", {})])
def test_the_backend_matches_our_own_file_at_tp2(tmp_path, model_type, fields):
    """Where we have a model file, the backend's numbers are its numbers at tp 2 (Mistral's
    window shorter than the prompts: our ring cache against the backend's positional one)."""
    folder = hf_tiny(model_type, tmp_path / model_type, **fields)
    runs = {}
    for impl in ("native", "transformers"):
        checkpoint = open_checkpoint(folder, impl)
        spec = RunSpec(str(folder), checkpoint=checkpoint, tp=2, prompts=PROMPTS,
                       max_new_tokens=STEPS)
        results = get_pool(2).run(run_rank, spec)
        assert {r.model_impl for r in results} == {impl}
        runs[impl] = merge(results)
    assert_logits_match(runs["transformers"], runs["native"], len(PROMPTS))
