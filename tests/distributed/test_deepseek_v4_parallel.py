"""DeepSeek-V4 under TP, attention DP and expert parallelism on gloo ranks against world 1:
sliding-window attention heads (and their output groups) over attention TP, the MoE (routed
experts over moe_ep x moe_tp, shared expert over TP) on every DP rank's rows, the mHC update
applied by the boundary after each sum. Hash-routed layers take the ids of the MoE's rows from
one gather per forward; every layer's two sums are counted in the ledger, each completed once."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from checkpoints.ds4 import TINY_DS4, hf_deepseek_v4

from layer_boundary.engine.runner import RunSpec, merge, run_rank

from .checks import assert_logits_match, cli, run_matching_world1, world1
from .pool import get_pool

LAYERS = TINY_DS4["num_hidden_layers"]
# longer than the window (4), a short one, and one for a third DP rank; dp=4 leaves one idle
PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))
STEPS = 3  # a prefill, then two cached decode steps

# (tp, attn_dp, moe_ep, policy, expected row mode of the prefill)
CASES = [
    (2, 1, 1, "ar", "ar"),
    (2, 1, 2, "rs", "rs"),
    (4, 1, 4, "rs", "rs"),  # pure EP
    (4, 2, 2, "ar", "ar"),
    (4, 2, 1, "rs", "rs"),
    (4, 2, 2, "rsv", "rsv"),
    (4, 2, 2, "auto", "rsv"),  # auto resolves to rs+rsv for deepseek_v4
    (4, 4, 2, "rs+rsv", "rsv"),  # attention DP 4 with an empty DP rank
    (4, 4, 4, "ar", "ar"),  # the same in all-reduce mode
]

SUMS = ("all_reduce", "reduce_scatter")


def check_ledger(ledger, attn_tp: int, dp: int, steps: int) -> None:
    """Per forward and layer: the attention's attn_tp sum (when attention TP > 1) and the
    MoE's TP sum each completed once, by their consumer's input or the producer's own exit;
    nothing else summed. The hash layers' ids: one int64 gather over attention DP (none
    without attention DP), on the first hash layer's rows."""
    for step in range(steps):
        sums = [e for e in ledger if e.step == step and e.kind in SUMS
                and e.site not in ("embed", "lm_head")]
        claimed = set()
        for i in range(LAYERS):
            nxt = f"layer{i + 1}.attn.prepare" if i + 1 < LAYERS else "final_norm"
            owed = {"moe": ((f"layer{i}.ffn.compute", nxt), ("tp",))}
            if attn_tp > 1:
                owed["attn"] = ((f"layer{i}.ffn.prepare",), ("attn_tp", "tp"))
            for name, (sites, groups) in owed.items():
                done = [e for e in sums if e.site in sites]
                assert len(done) == 1, (step, i, name, [(e.site, e.group) for e in done])
                assert done[0].group in groups, (step, i, name, done[0].group)
                claimed.add(id(done[0]))
        stray = [(e.site, e.group, e.kind) for e in sums if id(e) not in claimed]
        assert not stray, f"step {step}: sums no contribution owes: {stray}"
        ids = [e for e in ledger if e.step == step and e.dtype == torch.int64]
        assert [(e.kind, e.group, e.site) for e in ids] == (
            [("all_gather", "attn_dp", "layer0.ffn.compute")] if dp > 1 else []), (step, ids)


@pytest.fixture(scope="module")
def ds4_dir(tmp_path_factory):
    return str(hf_deepseek_v4(tmp_path_factory.mktemp("deepseek_v4")))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,ep,policy,mode", CASES,
                         ids=[f"tp{c[0]}-dp{c[1]}-ep{c[2]}-{c[3]}" for c in CASES])
def test_matches_world1(ds4_dir, tp, dp, ep, policy, mode):
    spec = RunSpec(ds4_dir, tp=tp, dp=dp, ep=ep, boundary_reduction=policy, prompts=PROMPTS,
                   max_new_tokens=STEPS)
    for r in run_matching_world1(spec, mode):
        check_ledger(r.ledger, tp // dp, dp, STEPS)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fusions", ["reference", "reference-terminal"])
def test_no_fusion_candidate_takes_an_mhc_input(ds4_dir, fusions):
    """The reference provider offers its fused add+norm to every input and may hand the
    MoE's finalize onward; an mHC update is never a plain add, so no candidate (and no final
    norm service) accepts anything, and the numbers are the unfused ones."""
    spec = RunSpec(ds4_dir, tp=4, dp=2, ep=2, boundary_reduction="ar", prompts=PROMPTS,
                   max_new_tokens=STEPS, fusions=fusions)
    results = get_pool(4).run(run_rank, spec)
    assert_logits_match(merge(results), world1(replace(spec, fusions=None)), len(PROMPTS))
    assert all(r.fused_inputs == 0 and r.fused_final_norms == 0 for r in results)


def test_ledger_check_catches_a_missing_or_doubled_sum():
    from layer_boundary.runtime.ledger import LedgerEntry

    def entry(site, group="tp", kind="all_reduce", dtype=torch.float32):
        return LedgerEntry(kind=kind, group=group, group_size=2, numel=64, dtype=dtype, site=site)

    good = [entry("layer0.ffn.compute", "attn_dp", "all_gather", torch.int64)]
    for i in range(LAYERS):
        good += [entry(f"layer{i}.ffn.prepare", "attn_tp"), entry(f"layer{i}.ffn.compute")]
    check_ledger(good, attn_tp=2, dp=2, steps=1)
    with pytest.raises(AssertionError):
        check_ledger(good[:2] + good[3:], attn_tp=2, dp=2, steps=1)  # a MoE never summed
    with pytest.raises(AssertionError):
        check_ledger(good + [good[2]], attn_tp=2, dp=2, steps=1)  # summed twice
    with pytest.raises(AssertionError):
        check_ledger(good + [good[0]], attn_tp=2, dp=2, steps=1)  # ids gathered twice
    with pytest.raises(AssertionError):
        check_ledger(good, attn_tp=2, dp=1, steps=1)  # ids gathered without DP


@pytest.mark.timeout(240)
def test_run_and_plan_commands(ds4_dir, capsys):
    """``run`` passes parity on a DeepSeek-V4 directory; ``plan`` shows each layer's two
    stages with the mHC update in every row mode."""
    code, out = cli(["run", "--model", ds4_dir, "--tp", "4", "--dp", "2", "--ep", "2",
                      "--boundary-reduction", "rs+rsv", "--max-new-tokens", "2"], capsys)
    assert code == 0 and "parity vs world 1: PASS" in out
    for policy in ("ar", "rs", "rsv"):
        code, out = cli(["plan", "--model", ds4_dir, "--tp", "4", "--dp", "2",
                          "--boundary-reduction", policy, "--json"], capsys)
        assert code == 0
        plan = json.loads(out)
        stages = [s["stage"] for s in plan["stages"]]
        assert stages == [f"layer{i}.{k}" for i in range(LAYERS) for k in ("attn", "ffn")]
        assert plan["mode"] == policy
        kinds = [s["kind"] for s in plan["stages"]]
        assert all("MhcUpdate" in k for k in kinds), kinds
