"""The communication ledger of a Qwen3 forward against the path's analytic collective list.

Proves the deferred FFN all-reduce really moves: with deferral the sum of layer i's FFN output
runs once, inside layer i+1's attention prepare; the terminal FFN completes its own output
in compute, so the final norm runs no collective.
"""

from __future__ import annotations

import pytest

from layer_boundary.models import load_config
from layer_boundary.engine.runner import RunSpec, run_rank

from .pool import get_pool

PROMPTS = ((1, 2, 3, 4, 5), (7, 8, 9))


def expected_forward(cfg, tokens: int, tp: int, deferred: bool) -> list[tuple]:
    rows = tokens * cfg.hidden_size
    padded_vocab = -(-cfg.vocab_size // tp) * tp
    out = [("all_reduce", "attn_tp", rows, "embed")]
    for i in range(cfg.num_hidden_layers):
        if i > 0:
            site = f"layer{i}.attn.prepare" if deferred else f"layer{i - 1}.ffn.compute"
            out.append(("all_reduce", "tp", rows, site))
        out.append(("all_reduce", "attn_tp", rows, f"layer{i}.ffn.prepare"))
    out.append(("all_reduce", "tp", rows, f"layer{cfg.num_hidden_layers - 1}.ffn.compute"))
    # the LM head computes (and gathers) each request's last row only
    out.append(("all_gather", "attn_tp", len(PROMPTS) * padded_vocab, "lm_head"))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("deferred", [True, False])
def test_ledger_matches_analytic_list(qwen3_dir, tp, deferred):
    spec = RunSpec(str(qwen3_dir), tp=tp, boundary_reduction="ar", prompts=PROMPTS,
                   max_new_tokens=2, allreduce_fusion=deferred)
    results = get_pool(tp).run(run_rank, spec)
    cfg = load_config(qwen3_dir)
    for r in results:  # every rank runs the same collectives
        for step, tokens in enumerate([sum(map(len, PROMPTS)), len(PROMPTS)]):
            got = [(e.kind, e.group, e.numel, e.site) for e in r.ledger if e.step == step]
            assert got == expected_forward(cfg, tokens, tp, deferred), f"rank {r.rank} step {step}"
            assert all(e.group_size == tp for e in r.ledger)


@pytest.mark.timeout(120)
def test_each_ffn_output_is_summed_exactly_once(qwen3_dir):
    spec = RunSpec(str(qwen3_dir), tp=2, boundary_reduction="ar", prompts=PROMPTS,
                   max_new_tokens=1)
    (r0, _) = get_pool(2).run(run_rank, spec)
    cfg = load_config(qwen3_dir)
    ffn_sums = [e.site for e in r0.ledger if e.group == "tp"]
    # one tp sum per layer: layers 0..L-2 at the next attention's prepare, the last in compute
    assert ffn_sums == [f"layer{i}.attn.prepare" for i in range(1, cfg.num_hidden_layers)] + [
        f"layer{cfg.num_hidden_layers - 1}.ffn.compute"]
    assert not [e for e in r0.ledger if e.site == "final_norm"]
