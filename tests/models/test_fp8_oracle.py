"""FP8 exactness: world 1 against a fake-quantization oracle, within fp32 noise.

The oracle is transformers on the dequantized weights whose stages read their normalized
input as the package's rule says (docs/features.md, FP8): quantized-dequantized per token and
per 1 x block_k group wherever every linear consuming it is FP8 (attention's q/k/v or MLA
latent projections, a dense MLP's gate/up, a MoE's routed and shared experts), the router
reading it unquantized (``checkpoints.fp8.fake_quantized_oracle``). Hidden size 56 leaves a
partial last group at every block size (16, 32, 128), and partial weight blocks beside it.

The tolerance is 1e-5 x the logit scale: a difference in what any stage reads is 1e-3 or
more at these sizes (the unquantized-input reference is asserted that far away). An input
within fp32 noise of an FP8 rounding boundary could round the other way on one side; these
seeds and prompts have none. (Such a flip is one position's logits 1e-5-1e-4 apart while every
other position stays at 3e-7: with batched SDPA attention, prompt (35, 8) had one in the
``qwen3-16-skip`` case, at its prefill's last position only, and none with explicit-softmax
attention; it was replaced by (35, 7).)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import hf_qwen3, hf_qwen3_moe
from checkpoints.ds import hf_deepseek_v3
from checkpoints.fp8 import dequantized_oracle, fake_quantized_oracle, fp8_checkpoint

from layer_boundary.engine.runner import RunSpec, merge, run_rank

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 7), (9, 7, 9, 3, 2))
TOL = 1e-5  # of the logit scale: fp32 noise
SIZES = dict(hidden_size=56, intermediate_size=72)  # 56: partial groups at 16, 32 and 128
CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "deepseek_v3": "DeepseekV3ForCausalLM"}
# (model, [out, in] block, modules_to_not_convert): each model at each block size; MLA
# without q LoRA (q_proj beside kv_a_proj reads the input); a stage with one linear left
# unquantized, which reads its input unquantized in every linear; the MoE models at hidden
# size 64 (whole groups: what the experts read is all that can differ there)
CASES = [(m, b, ()) for b in (16, 32, 128) for m in ("qwen3", "qwen3_moe", "deepseek_v3")] + [
    ("deepseek_v3_q_proj", 32, ()), ("qwen3", 16, ("layers.0.self_attn.q_proj",)),
    ("qwen3_moe", 32, ("layers.1.mlp.experts.3.up_proj",)), ("qwen3_moe_h64", 16, ()),
    ("deepseek_v3_h64", 32, ())]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_oracle_src")
    mla = dict(SIZES, moe_intermediate_size=24, kv_lora_rank=16)  # kv_b_proj: a partial block
    return {"qwen3": hf_qwen3(root / "qwen3", **SIZES),
            "qwen3_moe": hf_qwen3_moe(root / "qwen3_moe", moe_intermediate_size=24, **SIZES),
            "deepseek_v3": hf_deepseek_v3(root / "deepseek_v3", **mla),
            "deepseek_v3_q_proj": hf_deepseek_v3(root / "deepseek_v3_q_proj", q_lora_rank=None,
                                                 **mla),
            "qwen3_moe_h64": hf_qwen3_moe(root / "qwen3_moe_h64"),
            "deepseek_v3_h64": hf_deepseek_v3(root / "deepseek_v3_h64", kv_lora_rank=16)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model,block,skip", CASES, ids=[
    f"{m}-{b}" + ("-skip" if s else "") for m, b, s in CASES])
def test_world1_matches_the_fake_quantization_oracle(sources, tmp_path, model, block, skip):
    path = fp8_checkpoint(sources[model], tmp_path / "fp8", (block, block), skip=skip)
    ours = merge([run_rank(RunSpec(str(path), prompts=PROMPTS, max_new_tokens=2),
                           world_size=1)])
    architecture = CLASSES[model.split("_h64")[0].removesuffix("_q_proj")]
    oracle = fake_quantized_oracle(architecture, sources[model], path)
    unquantized = dequantized_oracle(architecture, sources[model], path)
    apart = 0.0
    for j, prompt in enumerate(PROMPTS):
        ids = torch.tensor([[*prompt, ours.generated[j][0]]])
        with torch.no_grad():  # the prefill's last position, then the decode step's
            expected, plain = oracle(ids).logits[0, -2:], unquantized(ids).logits[0, -2:]
        for step in (0, 1):
            scale = expected[step].abs().max().item()
            diff = (ours.logits[j][step] - expected[step]).abs().max().item()
            assert diff <= TOL * scale, (j, step, diff / scale)
            apart = max(apart, (plain[step] - expected[step]).abs().max().item() / scale)
    # the quantization the oracle applies is far above the tolerance, so the test can tell
    assert apart > 1e-3, apart
