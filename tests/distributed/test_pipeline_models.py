"""Every reference model under pipeline parallelism on gloo ranks: pp 2 x tp 2, an uneven
pp 3 split, and pp 2 with attention DP under rsv, with split prefill, against world 1 (every
step's logits, same tokens) and transformers (every request's prefill logits). The ledger
shows one handoff per step and stage boundary, carrying each token row once where the residual
is scattered; the sampled tokens reach every stage.
"""

from __future__ import annotations

import pytest
from checkpoints.ds4 import TINY_DS4

from layer_boundary.engine.generate import requests_of
from layer_boundary.engine.runner import RunSpec, merge, run_rank

from .checks import assert_logits_match, world1
from .models import MODELS, PROMPTS, STEPS, transformers_prefill
from .pool import get_pool

# (pp, tp, dp, ep, policy, split_prefill, pp_layers)
CASES = {
    "pp2-tp2": (2, 2, 1, 1, "auto", 2, None),
    "pp3-uneven": (3, 1, 1, 1, "ar", 1, None),
    "pp2-tp2-dp2-rsv": (2, 2, 2, 2, "rsv", 2, None),
}


def check_handoffs(results, spec: RunSpec, width: int) -> None:
    """Per step and stage boundary: each rank sends once, its receiver receives the same; the
    rows a DP rank sends over its attention-TP ranks are its tokens once (scattered residual)
    or once per rank (replicated residual); the sampled tokens reach every stage once."""
    attn_tp = spec.tp // spec.dp
    for step in range(STEPS):
        counts = [sum(len(PROMPTS[i]) if step == 0 else 1
                      for i in requests_of(d, spec.dp, len(PROMPTS))) for d in range(spec.dp)]
        sent = {}
        for r in results:
            entries = [e for e in r.ledger if e.step == step and e.group == "pp"]
            sends = [e for e in entries if e.kind == "send"]
            recvs = [e for e in entries if e.kind == "recv"]
            assert all(e.site == "pp_send" for e in sends) and len(sends) <= 1, (r.rank, sends)
            assert (len(sends) == 1 or counts[r.dp_rank] == 0) != r.last_stage, (r.rank, step)
            if r.pp_rank > 0 and counts[r.dp_rank]:
                assert [e.numel for e in recvs] == [sent[r.rank - spec.tp]], (r.rank, step)
            for e in sends:
                sent[r.rank] = e.numel
            tokens = [e for e in entries if e.kind == "broadcast"]
            n = len(requests_of(r.dp_rank, spec.dp, len(PROMPTS)))
            assert [(e.site, e.numel) for e in tokens] == ([("pp_tokens", n)] if n else [])
        for stage in range(spec.pp - 1):
            for d in range(spec.dp):
                ranks = [stage * spec.tp + d * attn_tp + a for a in range(attn_tp)]
                rows = sum(sent.get(rank, 0) for rank in ranks) // width
                expected = counts[d] * (1 if spec_mode(results) != "ar" else attn_tp)
                assert rows == expected, (step, stage, d, rows, expected)


def spec_mode(results) -> str:
    return results[0].modes[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model", list(MODELS))
def test_pipeline_matches_world1_and_transformers(model_dirs, model, case):
    pp, tp, dp, ep, policy, split, layers = CASES[case]
    spec = RunSpec(model_dirs[model], tp=tp, dp=dp, ep=ep, pp=pp, boundary_reduction=policy,
                   prompts=PROMPTS, max_new_tokens=STEPS, split_prefill=split,
                   pp_layers=layers)
    results = get_pool(pp * tp).run(run_rank, spec)
    run = merge(results)
    assert_logits_match(run, world1(spec), len(PROMPTS))
    for j, expected in enumerate(transformers_prefill(model, model_dirs[model])):
        diff = (run.logits[j][0] - expected).abs().max().item()
        assert diff <= 1e-5, f"request {j} prefill vs transformers: max abs diff {diff}"
    stages = sorted({r.layers for r in results})
    assert [len(s) for s in stages] == sorted(
        (len(s) for s in stages), reverse=True) and len(stages) == pp
    assert sorted(i for s in stages for i in s) == list(range(sum(map(len, stages))))
    assert all(r.streams_released for r in results)
    hidden = 64 * (TINY_DS4["hc_mult"] if model == "deepseek_v4" else 1)
    check_handoffs(results, spec, hidden)
