"""Rank functions scripts/gpu_check.py spawns (module-level, importable by the spawned ranks,
which get this process's ``sys.path``)."""

from __future__ import annotations

import torch

PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3]]


def compiled_step_over_gloo(path: str, device: str = "cuda") -> float:
    """One rank of two sharing GPU 0 over gloo: a prefill and a decode step, padded to their
    buckets and compiled by inductor (no CUDA graphs), against the same steps run eagerly on
    a second cache; the largest |logit difference|. What ``run --device cuda --tp 2
    --compile`` runs, without the engine, so that a failure keeps its traceback (``device``
    "cpu": the same on the CPU, where it runs)."""
    from layer_boundary.engine.compiled import compile_forward
    from layer_boundary.models import load_model
    from layer_boundary.runtime import BoundaryRuntime, ForwardBatch, ForwardMode, ParallelDims
    from layer_boundary.runtime.forward_batch import token_bucket
    from layer_boundary.runtime.parallel import build_parallel

    if device == "cuda":
        torch.cuda.set_device(0)
    runtime = BoundaryRuntime(build_parallel(ParallelDims(world_size=2, tp=2)),
                              boundary_reduction="ar")
    model = load_model(path, runtime, device=device)
    compiled = compile_forward(model, "inductor", padded=True)
    scratch = len(PROMPTS)
    outs = []
    with torch.no_grad():
        for forward in (model, compiled):
            cache = model.make_kv_cache(scratch + 1, 16)
            prefill = ForwardBatch.build(ForwardMode.EXTEND, PROMPTS, [0] * scratch,
                                         kv_cache=cache, device=device)
            forward(prefill.padded(token_bucket(prefill.num_tokens), scratch_slot=scratch))
            step = ForwardBatch.build(ForwardMode.DECODE, [[7], [8], [9]],
                                      [len(p) for p in PROMPTS], kv_cache=cache,
                                      device=device)
            outs.append(forward(step.padded(token_bucket(scratch), scratch_slot=scratch))
                        [:scratch].float().cpu())
    return (outs[1] - outs[0]).abs().max().item()
