"""The parity verdict: non-finite logits always fail (float32 and bfloat16, on either side),
the fp32 tolerance follows the logit scale, so legitimate large-logit checkpoints pass while a
corrupted shard still fails."""

from __future__ import annotations

import shutil

import pytest
import torch
from distributed.pool import get_pool

from layer_boundary.engine.generate import Generation
from layer_boundary.engine.parity import parity, verdict_ok
from layer_boundary.engine.runner import RunSpec, merge, run_rank

NAN = float("nan")


def gen(values, tokens=((1, 2),)) -> Generation:
    return Generation(list(range(len(tokens))), [list(t) for t in tokens],
                      [[torch.tensor(v) for v in steps] for steps in values])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("side", ["run", "reference"])
@pytest.mark.parametrize("bad", [NAN, float("inf")])
def test_non_finite_logits_fail(dtype, side, bad):
    good = gen([[[1.0, 2.0], [0.5, 0.1]]])
    broken = gen([[[1.0, 2.0], [bad, 0.1]]])  # a decode step (bf16 checks only the prefill)
    run, ref = (broken, good) if side == "run" else (good, broken)
    verdict = parity(run, ref)
    ok, how = verdict_ok(verdict, dtype, run, ref)
    assert not ok and verdict["non_finite"] == [side] and how.endswith(side)
    assert verdict["max_abs_diff"] != verdict["max_abs_diff"]  # reported as NaN


def test_nan_after_a_finite_difference_is_not_dropped():
    run = gen([[[1.0, 2.0], [1.0, NAN]]])
    ref = gen([[[1.0, 2.1], [1.0, 2.0]]])
    assert not verdict_ok(parity(run, ref), "float32", run, ref)[0]


def test_the_tolerance_follows_the_logit_scale():
    ref = gen([[[64.0, -3.0]]])
    close = gen([[[64.0 + 3e-4, -3.0]]])  # 5e-6 of the scale
    far = gen([[[64.0 + 3e-3, -3.0]]])
    assert verdict_ok(parity(close, ref), "float32", close, ref)[0]
    assert not verdict_ok(parity(far, ref), "float32", far, ref)[0]
    small = gen([[[0.2, -0.1]]])
    assert parity(small, small)["tolerance"] == 1e-5  # below a logit scale of 1: absolute


def scaled_copy(src, dst, factor: float) -> str:
    """The checkpoint with its LM head scaled: logits ``factor`` times larger."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * factor
    save_file(tensors, f"{dst}/model.safetensors")
    return str(dst)


PROMPTS = ((3, 1, 4, 1, 5), (9, 2, 6))


def scaled_spec(qwen3_dir, dst, factor: float) -> RunSpec:
    """tp=4 dp=2 rsv over the checkpoint with logits ``factor`` times larger."""
    return RunSpec(scaled_copy(qwen3_dir, dst, factor), tp=4, dp=2, boundary_reduction="rsv",
                   prompts=PROMPTS, max_new_tokens=3)


def _verdict(spec: RunSpec, results) -> tuple[bool, dict]:
    run = merge(results)
    ref = merge([run_rank(RunSpec(spec.model_dir, prompts=spec.prompts,
                                  max_new_tokens=spec.max_new_tokens), world_size=1)])
    verdict = parity(run, ref)
    return verdict_ok(verdict, spec.dtype, run, ref)[0], verdict


@pytest.mark.timeout(180)
@pytest.mark.parametrize("factor", [8.0, 64.0])
def test_large_logit_checkpoints_pass(qwen3_dir, tmp_path, factor):
    spec = scaled_spec(qwen3_dir, tmp_path / f"x{factor:g}", factor)
    ok, verdict = _verdict(spec, get_pool(4).run(run_rank, spec))
    assert ok, verdict
    assert verdict["logit_scale"] > factor / 8


def corrupted_rank_run(spec: RunSpec, rank: int, scale: float = 0.01):
    """run_rank with one rank's shard of one weight perturbed (``scale`` of its values' size)."""
    import torch.distributed as dist

    import layer_boundary.engine.runner as runner

    load = runner.load_model

    def corrupt(*args, **kwargs):
        model = load(*args, **kwargs)
        if dist.get_rank() == rank:
            with torch.no_grad():
                w = model.model.layers[1].mlp.down_proj.weight
                w.add_(scale * w.abs().mean() * torch.randn_like(w))
        return model

    runner.load_model = corrupt
    try:
        return run_rank(spec)
    finally:
        runner.load_model = load


@pytest.mark.timeout(180)
@pytest.mark.parametrize("factor", [1.0, 64.0])
def test_a_corrupted_shard_fails(qwen3_dir, tmp_path, factor):
    spec = scaled_spec(qwen3_dir, tmp_path / f"c{factor:g}", factor)
    ok, verdict = _verdict(spec, get_pool(4).run(corrupted_rank_run, spec, 1))
    assert not ok, verdict


@pytest.mark.timeout(180)
def test_bf16_passes_and_a_corrupted_shard_fails(qwen3_dir):
    """bfloat16 against the fp32 world 1: the legitimate run is within its bound; one rank's
    shard perturbed by its own size is not."""
    spec = RunSpec(str(qwen3_dir), tp=4, dp=2, boundary_reduction="rsv", prompts=PROMPTS,
                   max_new_tokens=2, dtype="bfloat16")
    ok, verdict = _verdict(spec, get_pool(4).run(run_rank, spec))
    assert ok, verdict
    ok, verdict = _verdict(spec, get_pool(4).run(corrupted_rank_run, spec, 1, 1.0))
    assert not ok, verdict


def test_the_verdict_records_the_bound_that_judged_it():
    """A bf16 run's tolerance is its prefill bound, not the fp32 figure; an FP8 run's too."""
    from layer_boundary.engine.parity import BF16_PREFILL_BOUND, FP8_PREFILL_BOUND

    run = gen([[[4.0, 1.0], [3.0, 2.0]]])
    for dtype, quantized, bound in (("bfloat16", False, BF16_PREFILL_BOUND),
                                    ("float32", True, FP8_PREFILL_BOUND)):
        verdict = parity(run, run)
        assert verdict_ok(verdict, dtype, run, run, quantized=quantized)[0]
        assert (verdict["tolerance"], verdict["tolerance_kind"]) == (bound, "prefill_relative")
    verdict = parity(run, run)
    assert verdict_ok(verdict, "float32", run, run)[0]
    assert (verdict["tolerance"], verdict["tolerance_kind"]) == (1e-5 * 4.0, "absolute")
