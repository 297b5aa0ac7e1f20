"""A model with a per-layer output transform on real gloo ranks against world 1.

The OLMo-2-style test model (``tests/olmo_like.py``) passes each stage's contribution through
its layer's own post-norm after the sum: a nonlinear function of the complete output, so a
path that applied it to a partial, applied it twice, or let a fused add stand in for it gives
other numbers. Pipeline parallelism (pp 2 x tp 2: each rank's stack built with its neighbours
on the other rank, the handoff after an FFN whose transformed update the sender applies) and
attention DP (tp 4, dp 2) with an idle DP rank under ar, rs and rsv all match world 1 on the
same requests, fp32, within 1e-5.
"""

from __future__ import annotations

import functools

import pytest
import torch
from checkpoints.olmo import hf_olmo2
from olmo_like import load_olmo_like

from layer_boundary.runtime import (BoundaryRuntime, ForwardBatch, ForwardMode, ParallelDims,
                                    build_parallel, recv_from_prev_stage, send_to_next_stage)

from .pool import get_pool

REQUESTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))

# (pp, tp, dp, policy, the DP rank of each request): DP rank 1 idle under attention DP
CASES = {
    "pp2-tp2-rs": (2, 2, 1, "rs", (0, 0, 0)),
    "pp2-tp2-dp2-rsv": (2, 2, 2, "rsv", (0, 0, 0)),
    "tp4-dp2-ar": (1, 4, 2, "ar", (0, 0, 0)),
    "tp4-dp2-rs": (1, 4, 2, "rs", (0, 0, 0)),
    "tp4-dp2-rsv": (1, 4, 2, "rsv", (0, 0, 0)),
}


@pytest.fixture(scope="module")
def olmo_dir(tmp_path_factory):
    return str(hf_olmo2(tmp_path_factory.mktemp("olmo2_parallel")))


def forward(path: str, pp: int, tp: int, dp: int, policy: str, placement) -> dict:
    """One prefill of this rank's DP share of REQUESTS; the last pipeline stage's logits."""
    dims = ParallelDims(world_size=pp * tp, tp=tp, pp=pp, attn_dp=dp)
    rt = BoundaryRuntime(build_parallel(dims), boundary_reduction=policy)
    par = rt.parallel
    model = load_olmo_like(path, rt)
    d = par.attn_dp_rank
    mine = [list(r) for r, owner in zip(REQUESTS, placement) if owner == d]
    counts = tuple(sum(len(r) for r, owner in zip(REQUESTS, placement) if owner == k)
                   for k in range(dp))
    fb = ForwardBatch.build(ForwardMode.EXTEND, mine, [0] * len(mine), dp_token_counts=counts,
                            kv_cache=model.make_kv_cache(len(REQUESTS), 16))
    with torch.no_grad():
        out = model(fb, None if par.first_stage else recv_from_prev_stage(par.pp_group))
    if not par.last_stage:
        send_to_next_stage(out, par.pp_group)
        out = None
    return {"logits": out, "requests": [j for j, owner in enumerate(placement) if owner == d],
            "mode": fb.rows.mode.value, "released": fb.residual_stream is None,
            "last": par.last_stage}


@functools.cache
def world1(path: str) -> list[torch.Tensor]:
    """Each request's logits with every request on one rank."""
    out = forward(path, 1, 1, 1, "ar", (0,) * len(REQUESTS))["logits"]
    return list(out.split([len(r) for r in REQUESTS]))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
def test_a_per_layer_transform_model_matches_world1(olmo_dir, case):
    pp, tp, dp, policy, placement = CASES[case]
    ref = world1(olmo_dir)
    results = get_pool(pp * tp).run(forward, olmo_dir, pp, tp, dp, policy, placement)
    checked = 0
    for rank, r in enumerate(results):
        assert r["released"] and r["mode"] == policy, (rank, r["mode"])
        if not r["last"]:
            continue
        rows = r["logits"].split([len(REQUESTS[j]) for j in r["requests"]])
        for j, logits in zip(r["requests"], rows):
            diff = (logits - ref[j]).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} request {j}: max abs diff {diff}"
            checked += 1
        if not r["requests"]:  # the idle DP rank ran every collective and holds no rows
            assert r["logits"].shape[0] == 0
    assert checked == tp // dp * len(REQUESTS)  # every attention-TP rank of the busy DP rank
