"""DeepSeek-V3 NextN/MTP drafting: the target's own extra layer proposes, the output is the
target's greedy decoding (world 1, proven against transformers, and transformers' prefill
here); the draft is a stack of its own (entered with previous=None, terminal at its one layer)
with its own boundary-reduction policy, as the declarations and the ledger show."""

from __future__ import annotations

import pytest
import torch
from checkpoints.ds import hf_deepseek_v3, hf_deepseek_v3_reference

from layer_boundary import stage_boundaries
from layer_boundary.models import load_model
from layer_boundary.models.nextn import add_nextn_layer, load_nextn
from layer_boundary.engine.runner import RunSpec, merge, run_rank, speculative_summary
from layer_boundary.runtime import BoundaryRuntime, ParallelDims, build_parallel

from .checks import assert_logits_match, world1
from .models import PROMPTS
from .pool import get_pool

LAYERS = 3  # TINY_DS: dense, MoE, MoE; the NextN block is layer 3 (MoE)


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    path = hf_deepseek_v3(tmp_path_factory.mktemp("ds3_mtp"))
    add_nextn_layer(path)
    return str(path)


def test_the_nextn_stack_enters_and_ends_on_its_own(mtp_dir):
    rt = BoundaryRuntime(build_parallel(ParallelDims()))
    target = load_model(mtp_dir, rt)
    draft = load_nextn(mtp_dir, BoundaryRuntime(rt.parallel), target)
    attn, ffn = stage_boundaries(draft)
    assert (attn.name, ffn.name) == (f"nextn{LAYERS}.attn", f"nextn{LAYERS}.ffn")
    assert attn.declaration.previous is None and not attn.declaration.terminal
    assert ffn.declaration.terminal and ffn.declaration.sparse
    # the target's own stack is unchanged: it still ends at its last layer
    assert stage_boundaries(target)[-1].declaration.terminal
    assert stage_boundaries(target)[-1].name == f"layer{LAYERS - 1}.ffn"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,dp,ep,policy,draft_policy", [
    (1, 1, 1, "ar", "auto"), (2, 1, 1, "auto", "auto"), (4, 2, 2, "rsv", "ar")])
def test_nextn_output_is_the_targets_greedy_decoding(mtp_dir, tp, dp, ep, policy, draft_policy):
    spec = RunSpec(mtp_dir, tp=tp, dp=dp, ep=ep, boundary_reduction=policy, prompts=PROMPTS,
                   max_new_tokens=6, speculative_algorithm="nextn", speculative_steps=2,
                   speculative_boundary_reduction=draft_policy)
    results = get_pool(tp).run(run_rank, spec)
    out = merge(results)
    assert_logits_match(out, world1(spec), len(PROMPTS))
    ref = hf_deepseek_v3_reference(mtp_dir)
    for j, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0, -1]
        assert (out.logits[j][0] - expected).abs().max().item() <= 1e-5
    assert speculative_summary(results)["target_forwards"] >= 1
    if tp == 1:
        return
    for r in results:
        draft = [e for e in r.ledger if e.site.startswith(f"nextn{LAYERS}.")]
        target = [e for e in r.ledger if e.site.startswith("layer")]
        assert draft and target
        # a final norm completes a sum only as a terminal FFN's reduce-scatter (rs/rsv);
        # under ar the draft's sums complete inside its own stack, so every one there is the
        # target's, one a forward in a scattered mode
        at_norm = [e.kind for e in r.ledger if e.site == "final_norm"
                   and e.kind in ("all_reduce", "reduce_scatter")]
        assert set(at_norm) <= {"reduce_scatter"}, at_norm
        if draft_policy == "ar":
            assert len(at_norm) == sum(m in ("rs", "rsv") for m in r.modes), (at_norm, r.modes)
            assert {e.kind for e in draft} <= {"all_reduce", "all_gather"}
            assert "reduce_scatter" in {e.kind for e in target}


def test_nextn_needs_the_layer_and_a_deepseek_v3_target(tmp_path, qwen3_dir, capsys):
    from .checks import cli

    plain = str(hf_deepseek_v3(tmp_path / "plain"))
    for model in (plain, str(qwen3_dir)):
        code, _ = cli(["run", "--model", model, "--speculative-algorithm", "nextn", "--tp", "1",
                       "--dp", "1"], capsys)
        assert code == 2
