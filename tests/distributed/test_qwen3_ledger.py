"""The communication ledger of a Qwen3 forward against the path's analytic collective list.

Proves the deferred FFN all-reduce really moves: with deferral the sum of layer i's FFN output
runs once, inside layer i+1's attention prepare; the terminal FFN completes its own output
in compute under ar, so the final norm runs no collective; under attention DP with rsv the
final norm reduce-scatters it and gathers the normalized rows (the analytic minimum).
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


def expected_attention_dp(cfg, local: int, total: int, requests: int, attn_tp: int) -> list:
    """rsv at tp 4 with attention DP 2, written from the topology alone: every boundary is
    one reduce-scatter and one all-gather (no all-reduce of the global rows), and so is the
    final norm: the terminal FFN's sum is reduce-scattered onto this rank's slice, normalized
    there and gathered to its DP rank's rows. ``local``: this DP rank's rows; ``total``:
    every DP rank's rows."""
    h = cfg.hidden_size
    padded_vocab = -(-cfg.vocab_size // attn_tp) * attn_tp
    out = [("all_reduce", "attn_tp", local * h, "embed")]
    for i in range(cfg.num_hidden_layers):
        if i > 0:
            out += [("reduce_scatter", "tp", total * h, f"layer{i}.attn.prepare"),
                    ("all_gather", "attn_tp", local * h, f"layer{i}.attn.prepare")]
        out += [("reduce_scatter", "attn_tp", local * h, f"layer{i}.ffn.prepare"),
                ("all_gather", "tp", total * h, f"layer{i}.ffn.prepare")]
    out += [("reduce_scatter", "tp", total * h, "final_norm"),
            ("all_gather", "attn_tp", local * h, "final_norm"),
            ("all_gather", "attn_tp", requests * padded_vocab, "lm_head")]
    return out


@pytest.mark.timeout(120)
def test_attention_dp_ledger_matches_analytic_list(qwen3_dir):
    """tp 4, attention DP 2, rsv: request i runs on DP rank i; prefill and a decode step."""
    spec = RunSpec(str(qwen3_dir), tp=4, dp=2, boundary_reduction="rsv", prompts=PROMPTS,
                   max_new_tokens=2)
    cfg = load_config(qwen3_dir)
    for r in get_pool(4).run(run_rank, spec):
        dp_rank = r.rank // 2
        total = [sum(map(len, PROMPTS)), len(PROMPTS)]
        local = [len(PROMPTS[dp_rank]), 1]
        for step in (0, 1):
            got = [(e.kind, e.group, e.numel, e.site) for e in r.ledger if e.step == step]
            assert got == expected_attention_dp(cfg, local[step], total[step], 1, 2), (
                f"rank {r.rank} step {step}")
