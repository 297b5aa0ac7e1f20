"""Collectives of ar, rs and rsv under attention DP (tp=4, attn_dp=2, skewed load) against the
analytic list of each path, and the rs fallback when padding is not allowed."""

from __future__ import annotations

import json

import pytest

from .checks import cli_ok
from layer_boundary.models import load_config
from layer_boundary.engine.runner import RunSpec, merge, run_rank

from .checks import assert_logits_match
from .pool import get_pool
from .test_qwen3_dp import prompts_for, world1

TP, DP = 4, 2
ATTN_TP = TP // DP


def expected_forward(cfg, mode: str, counts: tuple[int, ...], dp_rank: int,
                     requests: int) -> list[tuple]:
    """``requests``: this DP rank's, whose last rows the LM head computes and gathers."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    total, local = sum(counts), counts[dp_rank]
    # rs: each DP segment padded to a multiple of attn_tp
    seg = -(-max(counts) // ATTN_TP) * ATTN_TP
    out = [("all_reduce", "attn_tp", local * h, "embed")] if local else []

    def to_ffn(site):  # attention output (partial over attn_tp) to the FFN's global rows
        if mode == "ar":  # residual added on one rank, one TP all-reduce sums and gathers
            return [("all_reduce", "tp", total * h, site)]
        if mode == "rs":
            return [("reduce_scatter", "attn_tp", seg * h, site),
                    ("all_gather", "tp", DP * seg * h, site)]
        return ([("reduce_scatter", "attn_tp", local * h, site)] if local else []) + [
            ("all_gather", "tp", total * h, site)]

    def to_attn(site):  # FFN output (partial over tp, global rows) to the residual's rows
        if mode == "ar":
            return [("all_reduce", "tp", total * h, site)]
        if mode == "rs":
            return [("reduce_scatter", "tp", DP * seg * h, site),
                    ("all_gather", "attn_tp", seg * h, site)]
        return [("reduce_scatter", "tp", total * h, site)] + (
            [("all_gather", "attn_tp", local * h, site)] if local else [])

    for i in range(layers):
        if i > 0:
            out += to_attn(f"layer{i}.attn.prepare")
        out += to_ffn(f"layer{i}.ffn.prepare")
    if mode == "ar":  # the terminal FFN completes its own sum in compute
        out.append(("all_reduce", "tp", total * h, f"layer{layers - 1}.ffn.compute"))
    else:  # the final norm reduce-scatters it, normalizes the slice, gathers local rows
        out += to_attn("final_norm")
    padded_vocab = -(-cfg.vocab_size // ATTN_TP) * ATTN_TP
    if local:
        out.append(("all_gather", "attn_tp", requests * padded_vocab, "lm_head"))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["ar", "rs", "rsv"])
def test_ledger_matches_analytic_list_under_attention_dp(qwen3_dir, policy):
    prompts = prompts_for("skewed", DP)
    spec = RunSpec(str(qwen3_dir), tp=TP, dp=DP, boundary_reduction=policy, prompts=prompts,
                   max_new_tokens=2, trace=True)
    cfg = load_config(qwen3_dir)
    for r in get_pool(TP).run(run_rank, spec):
        assert r.modes == [policy, policy]
        for step in (0, 1):
            counts = tuple(sum(len(prompts[i]) if step == 0 else 1
                               for i in range(len(prompts)) if i % DP == d) for d in range(DP))
            got = [(e.kind, e.group, e.numel, e.site) for e in r.ledger if e.step == step]
            requests = len(range(r.dp_rank, len(prompts), DP))
            assert got == expected_forward(cfg, policy, counts, r.dp_rank, requests), (r.rank,
                                                                                      step)
            # the norm of every FFN input runs on the residual's rows: a 1/attn_tp slice
            # under rs (equal chunks, the last ranks shorter) and rsv (balanced), the DP rank's
            # rows under ar; real rows only
            local, chunk = counts[r.dp_rank], -(-max(counts) // ATTN_TP)
            want = {"ar": local, "rs": max(0, min(chunk, local - r.attn_tp_rank * chunk)),
                    "rsv": len(range(r.attn_tp_rank, local, ATTN_TP))}[policy]
            for t in r.traces:
                if t.step == step and t.site.endswith("ffn.prepare"):
                    assert t.residual.shape[0] == want, (r.rank, t.site, step)


@pytest.mark.timeout(120)
def test_ineligible_rs_falls_back_to_all_reduce(qwen3_dir, capsys):
    prompts = prompts_for("skewed", DP)  # 14 and 3 rows: padding needed for rs
    spec = RunSpec(str(qwen3_dir), tp=TP, dp=DP, boundary_reduction="rs", prompts=prompts,
                   max_new_tokens=2, rs_padding=False)
    results = get_pool(TP).run(run_rank, spec)
    # the prefill (14, 3 rows) needs padding and falls back; the decode step (2, 2) does not
    assert all(r.modes == ["ar", "rs"] for r in results)
    assert not [e for r in results for e in r.ledger if e.kind == "reduce_scatter" and e.step == 0]
    assert [e for r in results for e in r.ledger if e.kind == "reduce_scatter" and e.step == 1]
    assert_logits_match(merge(results), merge([world1(spec)]), len(prompts))
    # the plan for the same batch shape says so, and shows all-reduce paths
    out = cli_ok(["plan", "--model", str(qwen3_dir), "--tp", "4", "--dp", "2",
                  "--boundary-reduction", "rs", "--no-rs-padding", "--tokens", "14,3",
                  "--json"], capsys)
    plan = json.loads(out)
    assert plan["mode"] == "ar" and "fallback to ar" in plan["reason"]
    assert "all_reduce(tp)" in plan["stages"][2]["entry"]
    # with padding allowed, or rows that need none, rs is taken
    out = cli_ok(["plan", "--model", str(qwen3_dir), "--tp", "4", "--dp", "2",
                  "--boundary-reduction", "rs", "--no-rs-padding", "--tokens", "4,4",
                  "--json"], capsys)
    assert json.loads(out)["mode"] == "rs"
