"""LongCat-Flash at world 1 against transformers (fp32, eager): prefill logits at every
position and KV-cache decode logits against transformers' own cached decode, on checkpoints
whose routers pick the identity (zero-computation) experts for some tokens and not others; the
config and the topology checks."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints.lc import TINY_LC, hf_longcat_flash, hf_longcat_flash_reference
from oracle import MLA_TOL, assert_decode_matches, assert_prefill_matches, world1

from distributed.checks import cli_ok
from layer_boundary.models import load_model
from layer_boundary.models.loader import CheckpointError
from layer_boundary.models.longcat_flash import LongcatFlashConfig, check_parallel
from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode
from layer_boundary.runtime.parallel import ParallelDims

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 88, 2, 61, 33, 5, 9, 10, 11], [42]]
STEPS = 4

CASES = {
    "default": dict(),
    # tied embeddings, more zero experts than routed slots, top-3, another scaling factor
    "tied-top3": dict(seed=1, tie=True, zero_expert_num=4, moe_topk=3,
                      routed_scaling_factor=2.5, rope_theta=1e6),
}


def zero_expert_share(ref, prompts) -> float:
    """The fraction of transformers' top-k slots that chose an identity expert."""
    routed, chosen = ref.config.n_routed_experts, []

    def hook(module, args, out):
        chosen.append(out[2].flatten())

    handles = [layer.mlp.router.register_forward_hook(hook) for layer in ref.model.layers]
    try:
        with torch.no_grad():
            for prompt in prompts:
                ref(torch.tensor([prompt]))
    finally:
        for h in handles:
            h.remove()
    ids = torch.cat(chosen)
    return (ids >= routed).float().mean().item()


@pytest.mark.parametrize("case", list(CASES))
def test_world1_matches_transformers(tmp_path, case):
    path = hf_longcat_flash(tmp_path / case, **CASES[case])
    ours = load_model(path, world1())
    ref = hf_longcat_flash_reference(path)
    share = zero_expert_share(ref, PROMPTS)
    assert 0 < share < 1, f"identity experts chosen for {share:.0%} of slots: not a test of them"

    assert_prefill_matches(ours, ref, PROMPTS)
    assert_decode_matches(ours, ref, PROMPTS, STEPS, tol=MLA_TOL)


def test_identity_experts_are_not_dropped(tmp_path):
    """The same checkpoint with the identity experts' rows zeroed out of our MoE differs: the
    oracle above would see a missing (or doubled) identity term."""
    path = hf_longcat_flash(tmp_path / "ckpt")
    ours = load_model(path, world1())
    batch = lambda: ForwardBatch.build(ForwardMode.EXTEND, PROMPTS, [0] * len(PROMPTS),  # noqa: E731
                                       kv_cache=ours.make_kv_cache(len(PROMPTS), 11))
    with torch.no_grad():
        full = ours(batch())
        for layer in ours.model.layers:
            layer.mlp.experts.zero_experts = 0
        without = ours(batch())
    assert (full - without).abs().max().item() > 1e-3


def base_config(**overrides) -> dict:
    cfg = dict(TINY_LC, model_type="longcat_flash", hidden_act="silu")
    cfg.update(overrides)
    return cfg


def test_config_fields():
    cfg = LongcatFlashConfig.from_dict(base_config())
    assert (cfg.num_layers, cfg.num_hidden_layers, cfg.qk_head_dim) == (2, 4, 24)
    assert (cfg.n_routed_experts, cfg.zero_expert_num, cfg.moe_topk) == (8, 2, 2)
    # transformers' aliases: num_hidden_layers (two per decoder layer), num_experts_per_tok,
    # intermediate_size, moe_intermediate_size
    alias = base_config(num_hidden_layers=6, num_experts_per_tok=3, intermediate_size=48,
                        moe_intermediate_size=16)
    for name in ("num_layers", "moe_topk", "ffn_hidden_size", "expert_ffn_hidden_size"):
        del alias[name]
    cfg = LongcatFlashConfig.from_dict(alias)
    assert (cfg.num_layers, cfg.moe_topk, cfg.ffn_hidden_size,
            cfg.expert_ffn_hidden_size) == (3, 3, 48, 16)
    assert LongcatFlashConfig.from_dict(base_config(zero_expert_num=None)).zero_expert_num == 0


@pytest.mark.parametrize("overrides,field", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_parameters"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(router_bias=True), "router_bias"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(head_dim=16), "head_dim"),
    (dict(qk_head_dim=20), "qk_head_dim"),
    (dict(zero_expert_num=-1), "zero_expert_num"),
    (dict(moe_topk=11), "moe_topk"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
])
def test_config_rejects_unsupported(overrides, field):
    with pytest.raises(CheckpointError, match=field):
        LongcatFlashConfig.from_dict(base_config(**overrides))


def test_config_rejects_odd_attention_layer_count():
    cfg = base_config(num_hidden_layers=5)
    del cfg["num_layers"]
    with pytest.raises(CheckpointError, match="num_hidden_layers=5"):
        LongcatFlashConfig.from_dict(cfg)


@pytest.mark.parametrize("overrides,dims,field", [
    (dict(num_attention_heads=6, num_key_value_heads=6), ParallelDims(world_size=4, tp=4),
     "num_attention_heads"),
    (dict(ffn_hidden_size=90), ParallelDims(world_size=4, tp=4, attn_dp=4), "ffn_hidden_size"),
    (dict(n_routed_experts=6), ParallelDims(world_size=4, tp=4, moe_ep=4), "n_routed_experts"),
    (dict(expert_ffn_hidden_size=30), ParallelDims(world_size=4, tp=4), "expert_ffn_hidden_size"),
])
def test_check_parallel_names_the_field(overrides, dims, field):
    cfg = LongcatFlashConfig.from_dict(base_config(**overrides))
    with pytest.raises(ValueError, match=field):
        check_parallel(cfg, dims)
    check_parallel(cfg, ParallelDims())  # world 1 always fits


def test_plan_shows_both_branches_and_the_merge(tmp_path, capsys, restore_logger):
    """``layer-boundary plan`` on a LongCat-Flash directory: per decoder layer, attention 0 and
    the MoE, then the branch (dense FFN 0 entered with branch_input, attention 1, dense FFN 1),
    then the merge back into the MoE's output."""
    path = hf_longcat_flash(tmp_path / "ckpt")
    out = cli_ok(["plan", "--model", str(path), "--tp", "4", "--dp", "2",
                  "--boundary-reduction", "rs+rsv", "--tokens", "5,0", "--json"], capsys)
    plan = json.loads(out)
    stages = {s["stage"]: s for s in plan["stages"]}
    assert list(stages) == [name for i in range(TINY_LC["num_layers"]) for name in (
        f"layer{i}.attn", f"layer{i}.ffn", f"layer{i}.branch.ffn0", f"layer{i}.branch.attn",
        f"layer{i}.branch.ffn1", f"layer{i}.branch.ffn1.merge")]
    assert stages["layer0.branch.ffn0"]["entry"].startswith("branch_input from the prepared")
    assert "before its moe_out sum" in stages["layer0.branch.ffn1.merge"]["entry"]
    # under rsv the last layer's MoE leaves its sum to the final norm's reduce-scatter, so
    # the merge joins before it too; under ar it completes in its compute: a plain add
    assert "before its moe_out sum" in stages["layer1.branch.ffn1.merge"]["entry"]
    assert plan["mode"] == "rsv"
    out = cli_ok(["plan", "--model", str(path), "--tp", "4", "--dp", "2",
                  "--boundary-reduction", "ar", "--tokens", "5,0", "--json"], capsys)
    stages = {s["stage"]: s for s in json.loads(out)["stages"]}
    assert stages["layer1.branch.ffn1.merge"]["entry"].endswith("added to layer1.ffn's output")
    # the branch's last FFN leaves its sum to branch_output, which completes it (not the
    # next input, which takes the merged output)
    assert stages["layer0.branch.ffn1"]["exit"] == "tp sum left to branch_output (all-reduce)"
    assert "next input" not in stages["layer0.branch.ffn1"]["exit"]
