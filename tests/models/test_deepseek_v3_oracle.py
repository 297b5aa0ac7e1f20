"""DeepSeek-V3 at world 1 against transformers: logits (prefill and KV-cache decode) and the
experts each router picks, on random tiny checkpoints written by save_pretrained."""

from __future__ import annotations

import pytest
import torch
from checkpoints.ds import TINY_DS, hf_deepseek_v3, hf_deepseek_v3_reference

from layer_boundary.models import load_model
from layer_boundary.models.deepseek_v3 import DeepseekV3Config, check_parallel
from layer_boundary.engine.generate import greedy_generate
from layer_boundary.models.loader import CheckpointError
from layer_boundary.runtime.args import BoundaryRuntime
from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode
from layer_boundary.runtime.parallel import ParallelDims, build_parallel

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 88, 2, 61, 33]]
STEPS = 4
MARGIN = 1e-4  # router choices closer than this may legitimately flip between implementations

CASES = {
    # q LoRA, normalized top-k weights, interleaved rope, untied
    "qlora-norm-interleave": dict(),
    # no q LoRA (q_proj), unnormalized top-k weights, rotate-half rope, tied, rope theta 1e6,
    # routed scale 1 (tied logits are ~3x larger, and so is their fp32 noise: ~4e-6 here)
    "noqlora-nonorm-halfrope-tied": dict(q_lora_rank=None, norm_topk_prob=False,
                                         rope_interleave=False, tie=True, rope_theta=1e6,
                                         routed_scaling_factor=1.0),
    # q LoRA with attention biases, unnormalized weights, another seed
    "qlora-nonorm-bias": dict(norm_topk_prob=False, attention_bias=True, seed=1),
}


def world1():
    return BoundaryRuntime(build_parallel(ParallelDims()))


def router_margin(x: torch.Tensor, gate) -> torch.Tensor:
    """Per token, how far HF's router is from a different choice: the smaller of the gap
    between the topk_group-th and next group score and the gap between the k-th and next
    biased expert score inside the chosen groups (recomputed from the router's input)."""
    scores = torch.nn.functional.linear(x.float(), gate.weight.float()).sigmoid()
    choice = scores + gate.e_score_correction_bias
    grouped = choice.view(-1, gate.num_group, gate.num_experts // gate.num_group)
    group_scores = grouped.topk(2, dim=-1)[0].sum(-1).sort(dim=-1, descending=True)[0]
    group_gap = group_scores[:, gate.topk_group - 1] - group_scores[:, gate.topk_group]
    chosen = torch.zeros_like(group_scores).scatter_(
        1, grouped.topk(2, dim=-1)[0].sum(-1).topk(gate.topk_group, dim=-1)[1], 1.0)
    mask = chosen.bool().unsqueeze(-1).expand_as(grouped).reshape(choice.shape)
    ranked = choice.masked_fill(~mask, float("-inf")).sort(dim=-1, descending=True)[0]
    expert_gap = ranked[:, gate.top_k - 1] - ranked[:, gate.top_k]
    return torch.minimum(group_gap, expert_gap)


def hf_router_choices(ref, sequences):
    """HF's chosen expert ids [T, k] and decision margins [T] per MoE layer, rows in order."""
    picks, margins, handles = {}, {}, []
    for i, layer in enumerate(ref.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "e_score_correction_bias"):
            continue  # dense layer

        def hook(module, args, out, i=i):
            x = args[0].reshape(-1, args[0].shape[-1])
            picks.setdefault(i, []).append(out[2].reshape(x.shape[0], -1))
            margins.setdefault(i, []).append(router_margin(x, module))
        handles.append(gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            for seq in sequences:
                ref(torch.tensor([seq]))
    finally:
        for h in handles:
            h.remove()
    return ({i: torch.cat(v) for i, v in picks.items()},
            {i: torch.cat(v) for i, v in margins.items()})


def our_router_choices(ours, sequences):
    """Our chosen expert ids per MoE layer for ONE prefill of all sequences."""
    picks, handles = {}, []
    for i, layer in enumerate(ours.model.layers):
        if hasattr(layer.mlp, "gate"):
            handles.append(layer.mlp.gate.register_forward_hook(
                lambda m, a, out, i=i: picks.__setitem__(i, out[1])))
    cache = ours.make_kv_cache(len(sequences), max(map(len, sequences)))
    batch = ForwardBatch.build(ForwardMode.EXTEND, sequences, [0] * len(sequences),
                               kv_cache=cache)
    try:
        with torch.no_grad():
            ours(batch)
    finally:
        for h in handles:
            h.remove()
    return picks


@pytest.mark.parametrize("case", list(CASES))
def test_world1_matches_transformers(tmp_path, case):
    path = hf_deepseek_v3(tmp_path / case, **CASES[case])
    ours = load_model(path, world1())
    ref = hf_deepseek_v3_reference(path)

    # logits: our prefill + KV-cache decode against the full sequence through transformers
    gen = greedy_generate(ours, PROMPTS, STEPS)
    sequences = []
    for j, prompt in enumerate(PROMPTS):
        seq = prompt + gen.generated[j][:-1]
        sequences.append(seq)
        with torch.no_grad():
            expected = ref(torch.tensor([seq])).logits[0]
        for step in range(STEPS):
            diff = (expected[len(prompt) - 1 + step] - gen.logits[j][step]).abs().max().item()
            assert diff <= 1e-5, f"prompt {j} step {step}: max abs diff {diff}"
        assert gen.generated[j] == expected[len(prompt) - 1:].argmax(-1).tolist()

    # routing: the same experts for every token whose choice is not a near-tie
    hf_ids, margins = hf_router_choices(ref, sequences)
    our_ids = our_router_choices(ours, sequences)
    moe_layers = [i for i in range(TINY_DS["num_hidden_layers"])
                  if i >= TINY_DS["first_k_dense_replace"]]
    assert sorted(hf_ids) == sorted(our_ids) == moe_layers
    for i in moe_layers:
        clear = margins[i] > MARGIN
        assert clear.float().mean() >= 0.75, f"layer {i}: too many router near-ties to compare"
        hf_sets = hf_ids[i].sort(dim=-1)[0][clear]
        our_sets = our_ids[i].sort(dim=-1)[0][clear]
        bad = (hf_sets != our_sets).any(-1).nonzero().flatten().tolist()
        assert not bad, f"layer {i}: routed experts differ at clear tokens {bad}"


def base_config(**overrides) -> dict:
    cfg = dict(TINY_DS, model_type="deepseek_v3", hidden_act="silu", rope_interleave=True,
               rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    cfg.update(overrides)
    return cfg


def test_config_fields():
    cfg = DeepseekV3Config.from_dict(base_config(q_lora_rank=None, rope_interleave=False))
    assert cfg.q_lora_rank is None and cfg.q_latent_dim == cfg.hidden_size
    assert not cfg.rope_interleave and cfg.rope_theta == 1e4
    assert cfg.qk_head_dim == 24 and cfg.softmax_scale == 24 ** -0.5
    assert [cfg.is_moe(i) for i in range(3)] == [False, True, True]
    legacy = DeepseekV3Config.from_dict(base_config(rope_parameters=None, rope_theta=5e5))
    assert legacy.rope_theta == 5e5


@pytest.mark.parametrize("overrides,field", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 40.0, "rope_theta": 1e4}),
     "rope_parameters.rope_type"),
    (dict(rope_parameters=None, rope_scaling={"type": "yarn", "factor": 4.0}),
     "rope_scaling.type"),
    (dict(n_group=3), "n_routed_experts"),
    (dict(topk_group=5), "topk_group"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(kv_lora_rank=None), "kv_lora_rank"),
    (dict(num_key_value_heads=1), "num_key_value_heads"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
])
def test_config_rejects_unsupported(overrides, field):
    with pytest.raises(CheckpointError, match=field.replace(".", r"\.")):
        DeepseekV3Config.from_dict(base_config(**overrides))


@pytest.mark.parametrize("overrides,dims,field", [
    (dict(), ParallelDims(world_size=8, tp=8), "num_attention_heads"),
    (dict(n_routed_experts=6, n_group=3, topk_group=2), ParallelDims(world_size=4, tp=4, moe_ep=4),
     "n_routed_experts"),
    (dict(moe_intermediate_size=50), ParallelDims(world_size=4, tp=4, attn_dp=4),
     "moe_intermediate_size"),
    (dict(intermediate_size=90), ParallelDims(world_size=4, tp=4, attn_dp=4, moe_ep=4),
     "intermediate_size"),
    (dict(moe_intermediate_size=6, n_shared_experts=1),
     ParallelDims(world_size=4, tp=4, attn_dp=4, moe_ep=2), "n_shared_experts"),
])
def test_check_parallel_names_the_field(overrides, dims, field):
    cfg = DeepseekV3Config.from_dict(base_config(**overrides))
    with pytest.raises(ValueError, match=field):
        check_parallel(cfg, dims)
    check_parallel(cfg, ParallelDims())  # world 1 always fits
