"""Summed exactly once (sglang#37187: GPT-OSS at TP4/DP4/EP4 scored 0/128 on GSM8K because its
MoE all-reduced in compute and the attention-DP step then reduce-scattered the same output).

An MoE whose compute completes its own sum, under attention DP with ``rs`` and ``rsv``, is
summed once: the boundary slices the complete output onto each DP rank's rows instead of
summing it again, and the audit (``engine.audit``) finds one sum per output. A compute that
sums behind its declaration's back (it all-reduces whatever the exit decided) is named by
the audit: the stage, and each sum that ran.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from layer_boundary.engine.runner import RunSpec, merge, run_rank
from layer_boundary.models import moe

from .checks import assert_logits_match, sums_of_ffn_outputs, world1
from .pool import get_pool

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", ["rs", "rsv"])
def test_an_moe_completing_its_own_sum_under_attention_dp_is_summed_once(qwen3_moe_dir,
                                                                          policy):
    """Its compute all-reduces where the exit lets it (``allreduce_fusion`` off: the terminal
    MoE, every one under ``ar``); under a reduce-scatter mode the exit has it skip that sum,
    and the reduce-scatter is the one sum. Never both."""
    spec = RunSpec(str(qwen3_moe_dir), tp=4, dp=2, ep=2, boundary_reduction=policy,
                   prompts=PROMPTS, max_new_tokens=2, allreduce_fusion=False)
    results = get_pool(4).run(run_rank, spec)
    assert_logits_match(merge(results), world1(spec), len(PROMPTS))
    for r in results:
        assert r.audit == [] and r.unaudited is None
        assert r.modes == [policy, policy]
        for step in (0, 1):
            sums = sums_of_ffn_outputs(r.ledger, 3, step)
            assert all(len(s) == 1 for s in sums.values()), (r.rank, step, sums)


def summed_behind_its_declaration(spec: RunSpec):
    """The run with every MoE all-reducing in compute whatever its exit decided (the bug):
    the AuditError the strict audit raises, as text, and whether the numbers still held."""
    real = moe.get_forward

    def always_sums():
        flags = real()
        return SimpleNamespace(skips_reduction=False, defer_moe_finalize=False,
                               **{k: getattr(flags, k) for k in dir(flags)
                                  if not k.startswith("_") and k not in
                                  ("skips_reduction", "defer_moe_finalize")})

    moe.get_forward = always_sums
    try:
        run_rank(spec, spec.tp)
    except RuntimeError as exc:  # the strict audit's AuditError
        return type(exc).__name__, str(exc)
    finally:
        moe.get_forward = real
    return None, None


@pytest.mark.timeout(180)
def test_a_compute_that_sums_behind_its_declaration_is_named(qwen3_moe_dir):
    spec = RunSpec(str(qwen3_moe_dir), tp=4, dp=2, ep=2, boundary_reduction="rsv",
                   prompts=PROMPTS, max_new_tokens=2)
    for name, message in get_pool(4).run(summed_behind_its_declaration,
                                         replace(spec, check_agreement=False)):
        assert name == "AuditError", message
        # layer 0 is dense (mlp_only_layers): the MoE layers 1 and 2 sum twice, every step
        assert message.startswith("step 0: layer1.ffn's output summed 2 times, declared "
                                  "once (over tp): all_reduce over tp at layer1.ffn.compute, "
                                  "reduce_scatter over tp at layer2.attn.prepare; step 0: "
                                  "layer2.ffn's output summed 2 times"), message
