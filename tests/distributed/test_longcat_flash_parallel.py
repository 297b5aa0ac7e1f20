"""LongCat-Flash under TP, attention DP and expert parallelism on gloo ranks against world 1:
two MLA attentions over attention TP, two dense FFNs over TP and the MoE (routed experts over
moe_ep x moe_tp, identity experts on one TP rank) per decoder layer, the dense FFNs and the
second attention a prepared branch merged back into the MoE's output. Every layer's five sums
are counted in the ledger: each completed exactly once, by the group its producer owes."""

from __future__ import annotations

import json

import pytest
from checkpoints.lc import TINY_LC, hf_longcat_flash

from layer_boundary.engine.runner import RunSpec

from .checks import cli, run_matching_world1

LAYERS = TINY_LC["num_layers"]
PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))  # dp=4 leaves a rank idle
STEPS = 3  # a prefill, then two cached decode steps

# (tp, attn_dp, moe_ep, policy, fusions, expected row mode of the prefill)
CASES = [
    (2, 1, 1, "ar", None, "ar"),
    (4, 1, 4, "rs", None, "rs"),  # pure EP; the identity experts on TP rank 0 only
    (4, 2, 2, "ar", None, "ar"),
    (4, 2, 1, "rs", None, "rs"),
    (4, 2, 2, "rsv", None, "rsv"),
    (4, 2, 2, "auto", None, "rsv"),  # auto resolves to rs+rsv for longcat_flash
    (4, 4, 2, "rs+rsv", None, "rsv"),  # attention DP 4 with an empty DP rank
    (4, 4, 1, "ar", "reference", "ar"),  # empty rank; the MoE's finalize handed onward
]

SUMS = ("all_reduce", "reduce_scatter")


def analytic_sums(layer: int, attn_tp: int) -> dict[str, tuple]:
    """Each contribution of decoder layer ``layer`` whose sum some rank owes, with the sites
    that may complete it (its producer's compute or exit, or its consumer's input) and the
    groups it may run on (an attention's attn_tp sum may be folded into a TP-wide sum that
    also gathers attention-DP rows)."""
    i, nxt = layer, f"layer{layer + 1}.attn.prepare" if layer + 1 < LAYERS else None
    attn = ("attn_tp", "tp")
    out = {
        "mlp0": ((f"layer{i}.branch.ffn0.compute", f"layer{i}.branch.attn.prepare"), ("tp",)),
        "mlp1": ((f"layer{i}.branch.ffn1.compute", f"layer{i}.branch.ffn1.branch_output"),
                 ("tp",)),
        # the MoE's sum, which also completes the merged branch output
        "moe": ((f"layer{i}.ffn.compute",) + ((nxt,) if nxt else ("final_norm",)), ("tp",)),
    }
    if attn_tp > 1:  # otherwise the attentions' outputs are complete as computed
        out["attn0"] = ((f"layer{i}.attn.compute", f"layer{i}.ffn.prepare"), attn)
        out["attn1"] = ((f"layer{i}.branch.attn.compute", f"layer{i}.branch.ffn1.prepare"), attn)
    return out


def check_sums_per_layer(ledger, attn_tp: int, steps: int) -> None:
    for step in range(steps):
        sums = [e for e in ledger if e.step == step and e.kind in SUMS
                and e.site not in ("embed", "lm_head")]
        claimed = set()
        for layer in range(LAYERS):
            for name, (sites, groups) in analytic_sums(layer, attn_tp).items():
                done = [e for e in sums if e.site in sites]
                assert len(done) == 1, (step, layer, name, [(e.site, e.group) for e in done])
                assert done[0].group in groups, (step, layer, name, done[0].group)
                claimed.add(id(done[0]))
        stray = [(e.site, e.group, e.kind) for e in sums if id(e) not in claimed]
        assert not stray, f"step {step}: sums no contribution owes: {stray}"


@pytest.fixture(scope="module")
def lc_dir(tmp_path_factory):
    return str(hf_longcat_flash(tmp_path_factory.mktemp("longcat_flash")))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,ep,policy,fusions,mode", CASES,
                         ids=[f"tp{c[0]}-dp{c[1]}-ep{c[2]}-{c[3]}" + (f"-{c[4]}" if c[4] else "")
                              for c in CASES])
def test_matches_world1(lc_dir, tp, dp, ep, policy, fusions, mode):
    spec = RunSpec(lc_dir, tp=tp, dp=dp, ep=ep, boundary_reduction=policy, prompts=PROMPTS,
                   max_new_tokens=STEPS, fusions=fusions)
    results = run_matching_world1(spec, mode)
    for r in results:
        check_sums_per_layer(r.ledger, tp // dp, STEPS)
    if fusions == "reference":
        assert all(r.fused_inputs > 0 for r in results)


def test_a_missing_or_doubled_branch_sum_is_caught():
    """The per-layer check fails on a ledger with one branch sum dropped or run twice."""
    import torch

    from layer_boundary.runtime.ledger import LedgerEntry

    def entry(site, group="tp"):
        return LedgerEntry(kind="all_reduce", group=group, group_size=2, numel=64,
                           dtype=torch.float32, site=site)

    def ledger(layer):
        nxt = (f"layer{layer + 1}.attn.prepare" if layer + 1 < LAYERS
               else f"layer{layer}.ffn.compute")
        return [entry(f"layer{layer}.ffn.prepare", "attn_tp"),
                entry(f"layer{layer}.branch.attn.prepare"),
                entry(f"layer{layer}.branch.ffn1.prepare", "attn_tp"),
                entry(f"layer{layer}.branch.ffn1.branch_output"), entry(nxt)]

    good = [e for i in range(LAYERS) for e in ledger(i)]
    check_sums_per_layer(good, attn_tp=2, steps=1)
    with pytest.raises(AssertionError):
        check_sums_per_layer(good[:3] + good[4:], attn_tp=2, steps=1)  # mlp1 never summed
    with pytest.raises(AssertionError):
        check_sums_per_layer(good + [good[3]], attn_tp=2, steps=1)  # mlp1 summed twice
    with pytest.raises(AssertionError):
        check_sums_per_layer(good, attn_tp=1, steps=1)  # attention sums that nothing owes


@pytest.mark.timeout(240)
def test_run_and_plan_commands(lc_dir, capsys):
    """``run`` passes parity on a LongCat-Flash directory; ``plan`` lists both branches and
    the merge in every row mode."""
    code, out = cli(["run", "--model", lc_dir, "--tp", "4", "--dp", "2", "--ep", "2",
                      "--boundary-reduction", "rs+rsv", "--max-new-tokens", "2"], capsys)
    assert code == 0 and "parity vs world 1: PASS" in out
    for policy in ("ar", "rs", "rsv"):
        code, out = cli(["plan", "--model", lc_dir, "--tp", "4", "--dp", "2",
                          "--boundary-reduction", policy, "--json"], capsys)
        stages = [s["stage"] for s in json.loads(out)["stages"]]
        for i in range(LAYERS):
            assert stages.index(f"layer{i}.ffn") < stages.index(f"layer{i}.branch.ffn0") \
                < stages.index(f"layer{i}.branch.attn") < stages.index(f"layer{i}.branch.ffn1") \
                < stages.index(f"layer{i}.branch.ffn1.merge"), (policy, stages)
