"""``--fusions triton`` on the reference models, its kernels under the Triton interpreter:
every parallel run matches world 1 run without a provider, and the kernels completed every
stage input after the stack's entry (the FP8 checkpoint's through its quantized read, the
MoE one's final norm through the terminal service)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from checkpoints.ds import hf_deepseek_v3
from checkpoints.fp8 import fp8_checkpoint
from checkpoints.qwen3_next import hf_qwen3_next
from distributed.checks import assert_logits_match
from distributed.pool import get_pool
from offers import offers_not_as_declared

from layer_boundary.engine.runner import RunSpec, merge, run_rank

pytest.importorskip("triton")

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))


@pytest.fixture(scope="module")
def checkpoints(qwen3_dir, qwen3_moe_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("triton_models")
    return {"qwen3": str(qwen3_dir), "qwen3_moe": str(qwen3_moe_dir),
            "qwen3_fp8": str(fp8_checkpoint(qwen3_dir, root / "fp8", block=(16, 16))),
            "qwen3_5_moe": str(hf_qwen3_next(root / "q35moe", "qwen3_5_moe")),
            "deepseek_v3": str(hf_deepseek_v3(root / "dsv3"))}


# (model, tp, dp, ep, boundary reduction)
CASES = [(model, *topology) for model, ep in (("qwen3", 1), ("qwen3_moe", 2), ("qwen3_fp8", 1),
                                              ("qwen3_5_moe", 1))
         for topology in ((2, 1, ep, "ar"), (4, 2, ep, "rs+rsv"))]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model,tp,dp,ep,policy", CASES,
                         ids=[f"{m}-tp{t}-dp{d}-ep{e}-{p}" for m, t, d, e, p in CASES])
def test_triton_fusions_match_world1_and_fuse_every_input(checkpoints, model, tp, dp, ep,
                                                          policy):
    spec = RunSpec(checkpoints[model], tp=tp, dp=dp, ep=ep, boundary_reduction=policy,
                   prompts=PROMPTS, max_new_tokens=2, fusions="triton")
    results = get_pool(tp).run(run_rank, spec)
    world1 = merge([run_rank(replace(spec, tp=1, dp=1, ep=1, fusions=None), world_size=1)])
    assert_logits_match(merge(results), world1, len(PROMPTS))
    layers = len(results[0].layers)
    inputs = [f"layer{i}.{s}" for i in range(layers) for s in ("attn", "ffn")][1:]
    for rank, r in enumerate(results):
        assert r.fused_stages == inputs, (rank, r.fused_stages)
        if model == "qwen3_5_moe" and dp == 1:  # its last MoE hands its finalize to the final
            assert r.fused_final_norms > 0, rank  # norm, on the residual's rows without DP


# the other batch variants: a sequence-parallel prefill (its stages complete on scattered
# rows), input-scattered forwards of an MLA model (its latent runs before the gather)
VARIANTS = [("qwen3", dict(sequence_parallel=True)),
            ("deepseek_v3", dict(attn_input_scattered=True))]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model,variant", VARIANTS, ids=[m for m, _ in VARIANTS])
def test_triton_fusions_in_the_scattered_variants(checkpoints, model, variant):
    # one forward (the prefill: the variant's own batch), so the fused stages are its
    spec = RunSpec(checkpoints[model], tp=4, dp=2, boundary_reduction="rs+rsv",
                   prompts=PROMPTS, max_new_tokens=1, fusions="triton", **variant)
    results = get_pool(4).run(run_rank, spec)
    world1 = merge([run_rank(replace(spec, tp=1, dp=1, fusions=None, sequence_parallel=False,
                                     attn_input_scattered=False), world_size=1)])
    assert_logits_match(merge(results), world1, len(PROMPTS))
    layers = len(results[0].layers)
    inputs = [f"layer{i}.{s}" for i in range(layers) for s in ("attn", "ffn")][1:]
    for rank, r in enumerate(results):
        assert len(r.modes) == 1
        assert r.fused_stages == inputs, (rank, r.fused_stages)
    # and on every path the model's plans built (the variant's, the ordinary batch's; every
    # row mode), each arrival is offered the one candidate declared for its movement
    assert get_pool(4).run(paths_not_as_declared, spec) == [[]] * 4


def paths_not_as_declared(spec) -> list:
    """The model of ``spec`` on this rank with the provider installed, as ``run`` builds it:
    its stages' arrivals offered anything but their declared candidate."""
    import torch

    from layer_boundary.engine.runner import make_fusions, make_runtime, with_checkpoints
    from layer_boundary.models import load_model

    spec = with_checkpoints(spec)
    model = load_model(spec.checkpoint, make_runtime(spec, torch.distributed.get_world_size()))
    model.install_fusion(make_fusions(spec.fusions))
    return offers_not_as_declared(model.stack.stages)
