"""Every collective a forward runs is the one its plan says, derived from the movement table.

On each rank the expected list is built from the model's own stage plans (the entry path for
what the previous exit decision leaves, the sum an exit completes in compute, the final
norm's movements) and the forward's row facts, then compared with the ledger, site by site
and in order. The embedding and LM head are runtime layers, outside any plan.
"""

from __future__ import annotations

import pytest

from layer_boundary import stage_boundaries
from layer_boundary.contracts import BatchVariant
from layer_boundary.row_modes import select_mode
from layer_boundary.models import load_model
from layer_boundary.engine.generate import greedy_generate, requests_of
from layer_boundary.engine.runner import RunSpec, make_runtime
from layer_boundary.ops import row_facts
from layer_boundary.runtime import LEDGER

from .pool import get_pool
from .test_qwen3_dp import prompts_for

STEPS = 2


def _site(entries, site):
    return [(kind, group, numel, site) for kind, group, numel in entries]


def expected_from_plans(model, rows, hidden: int, vocab: int, requests: int) -> list[tuple]:
    """``requests``: this DP rank's; the LM head computes and gathers their last rows."""
    attn_tp = rows.parallel.attn_tp_group
    out = []
    if attn_tp.size > 1 and rows.local:
        out.append(("all_reduce", "attn_tp", rows.local * hidden, "embed"))
    arrival, decision = "enter", None
    for stage in stage_boundaries(model):
        path = stage.plan.paths[(BatchVariant.ORDINARY, rows.mode)]
        out += _site(path.entry.expected(arrival, rows, hidden), f"{stage.name}.prepare")
        decision = path.exit.default
        if decision.compute_sum is not None:
            out += _site(decision.compute_sum.expected(rows, hidden), f"{stage.name}.compute")
        arrival = decision.arrivals()[0]
    # the final norm completes what the last exit left onto the residual's rows, normalises
    # there and brings its output to local rows
    residual, local = rows.layouts.residual(rows.mode), rows.layouts.local
    if decision.finish_move is not None:
        owed, src = None, decision.finish_move.dst
    else:
        owed, src = decision.owed, decision.rows
    out += _site(rows.movement(owed, src, residual).expected(rows, hidden)
                 + rows.movement(None, residual, local).expected(rows, hidden), "final_norm")
    if attn_tp.size > 1 and rows.local:
        padded = -(-vocab // attn_tp.size) * attn_tp.size
        out.append(("all_gather", "attn_tp", requests * padded, "lm_head"))
    return out


def compare(spec: RunSpec) -> list:
    runtime = make_runtime(spec, spec.tp)
    model = load_model(spec.model_dir, runtime)
    par, cfg = runtime.parallel, model.config
    prompts = [list(p) for p in spec.prompts]

    def step_of(step):
        LEDGER.step = step

    with LEDGER.recording() as entries:
        greedy_generate(model, prompts, STEPS, dp=spec.dp, dp_rank=par.attn_dp_rank,
                        on_step=step_of)
    out = []
    for step in range(STEPS):
        counts = tuple(sum(len(prompts[i]) if step == 0 else 1
                           for i in requests_of(d, spec.dp, len(prompts)))
                       for d in range(spec.dp))
        mode, _ = select_mode(runtime, counts)
        rows = row_facts(mode, counts, par)
        got = [(e.kind, e.group, e.numel, e.site) for e in entries if e.step == step]
        requests = len(requests_of(par.attn_dp_rank, spec.dp, len(prompts)))
        out.append((step, mode.value, got, expected_from_plans(model, rows, cfg.hidden_size,
                                                               cfg.vocab_size, requests)))
    return out


# (tp, dp, ep, policy, load, allreduce_fusion)
CASES = [(2, 1, 1, "ar", "even", True), (2, 1, 1, "ar", "even", False),
         (2, 1, 1, "rs", "skewed", True), (4, 1, 1, "rs", "skewed", True),
         (4, 2, 1, "ar", "skewed", True), (4, 2, 1, "rs", "skewed", True),
         (4, 2, 1, "rsv", "skewed", True), (4, 2, 1, "rsv", "zero", True),
         (4, 4, 1, "rs", "zero", True)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,ep,policy,load,fusion", CASES,
                         ids=[f"tp{t}-dp{d}-{p}-{ld}{'' if f else '-nofusion'}"
                              for t, d, _, p, ld, f in CASES])
def test_ledger_is_what_the_plan_says(qwen3_dir, tp, dp, ep, policy, load, fusion):
    spec = RunSpec(str(qwen3_dir), tp=tp, dp=dp, ep=ep, boundary_reduction=policy,
                   prompts=prompts_for(load, dp), max_new_tokens=STEPS,
                   allreduce_fusion=fusion)
    for rank, steps in enumerate(get_pool(tp).run(compare, spec)):
        for step, mode, got, want in steps:
            assert mode == policy
            assert got, (rank, step)  # the forward ran collectives at all
            assert got == want, (rank, step)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,ep,policy", [(4, 2, 2, "rs"), (2, 1, 2, "ar")])
def test_moe_ledger_is_what_the_plan_says(qwen3_moe_dir, tp, dp, ep, policy):
    spec = RunSpec(str(qwen3_moe_dir), tp=tp, dp=dp, ep=ep, boundary_reduction=policy,
                   prompts=prompts_for("skewed", dp), max_new_tokens=STEPS)
    for rank, steps in enumerate(get_pool(tp).run(compare, spec)):
        for step, _mode, got, want in steps:
            assert got == want, (rank, step)
