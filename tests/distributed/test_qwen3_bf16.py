"""bf16 runs against the fp32 oracle with the documented bound (DESIGN.md, Numerics): the
prefill logits of every parallel path stay within BF16_PREFILL_BOUND of the logit scale."""

from __future__ import annotations

from dataclasses import replace

import pytest

from layer_boundary.engine.parity import BF16_PREFILL_BOUND, bf16_prefill_within_bound
from layer_boundary.engine.runner import (RunSpec, merge,
                                   run_rank)

from .pool import get_pool
from .test_qwen3_dp import prompts_for, world1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy", [(1, 1, "ar"), (2, 1, "rs"), (4, 2, "ar"), (4, 2, "rs"),
                                          (4, 2, "rsv")])
def test_bf16_prefill_within_bound_of_fp32_oracle(qwen3_dir, tp, dp, policy):
    spec = RunSpec(str(qwen3_dir), tp=tp, dp=dp, boundary_reduction=policy,
                   prompts=prompts_for("skewed", 2), max_new_tokens=1, dtype="bfloat16")
    results = ([run_rank(spec, world_size=1)] if tp == 1 else get_pool(tp).run(run_rank, spec))
    oracle = merge([world1(replace(spec, dtype="float32"))])
    ok, worst = bf16_prefill_within_bound(merge(results), oracle)
    assert ok, f"prefill logits off by {worst:.3g} of the logit scale (bound {BF16_PREFILL_BOUND})"
    assert worst > 0  # bf16 really ran: it cannot match fp32 exactly
