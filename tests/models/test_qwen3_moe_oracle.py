"""Qwen3-MoE at world 1 against transformers: logits (prefill and decode) and chosen experts."""

from __future__ import annotations

import pytest
import torch
from checkpoints import hf_qwen3_moe, hf_reference_moe
from test_qwen3_oracle import world1

from layer_boundary.models import load_model
from layer_boundary.engine.generate import greedy_generate
from layer_boundary.models.qwen3_moe import Qwen3MoeRouter

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 88, 2, 61, 33]]
STEPS = 3


def _capture(module_type, model, key):
    seen = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append(key(out)))
             for m in model.modules() if isinstance(m, module_type)]
    return seen, hooks


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_world1_matches_transformers_logits_and_experts(tmp_path, norm_topk_prob):
    path = hf_qwen3_moe(tmp_path, norm_topk_prob=norm_topk_prob)
    ours, ref = load_model(path, world1()), hf_reference_moe(path)
    gen = greedy_generate(ours, PROMPTS, STEPS)
    ref_router = type(ref.model.layers[1].mlp.gate)
    for j, prompt in enumerate(PROMPTS):
        ids = prompt + gen.generated[j][:-1]
        hf_seen, hf_hooks = _capture(ref_router, ref, lambda out: (out[0], out[2]))
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        for h in hf_hooks:
            h.remove()
        for step in range(STEPS):
            diff = (expected[len(prompt) - 1 + step] - gen.logits[j][step]).abs().max().item()
            assert diff <= 1e-5, f"prompt {j} step {step}: {diff}"

        # the experts our router picks for the full sequence, layer by layer
        our_seen, our_hooks = _capture(Qwen3MoeRouter, ours, lambda out: out[1])
        greedy_generate(ours, [ids], 1)
        for h in our_hooks:
            h.remove()
        assert len(our_seen) == len(hf_seen) > 0
        clear = 0
        for (logits, hf_ids), our_ids in zip(hf_seen, our_seen):
            probs = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True).values
            k = hf_ids.shape[-1]
            gap = probs[:, k - 1] - probs[:, k]  # near-ties may legitimately order differently
            for t in torch.nonzero(gap > 1e-4).flatten().tolist():
                assert set(hf_ids[t].tolist()) == set(our_ids[t].tolist()), (j, t)
                clear += 1
        assert clear >= 0.9 * sum(ids.shape[0] for _, ids in hf_seen)
