"""The Triton provider's per-head RMSNorm + rotate-half RoPE (``kernels.head_norm_rope``, under
the interpreter here): the numbers of ``RMSNorm`` then ``rope.rotate_half`` (bf16 to the bit,
fp32 within rounding) on q/k views of a fused projection; an attention takes it from the
provider only where it computes exactly those (Qwen3's, not Llama's, which has no q/k norm),
and a Qwen3 with the provider gives the logits it gives without."""

from __future__ import annotations

import pytest
import torch

from layer_boundary.models.rope import rotate_half
from layer_boundary.runtime.norm import RMSNorm

pytest.importorskip("triton")
from layer_boundary.fusions import kernels  # noqa: E402 - after the interpreter is chosen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_the_kernel_is_the_norm_then_the_rope(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    tokens, heads = 5, 4
    qkv = torch.randn(tokens, 3 * heads * head_dim, generator=gen).to(dtype)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)  # strided rows, as in a layer
    norm = RMSNorm(head_dim, 1e-6, dtype=dtype)
    norm.weight.data = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype)
    cos, sin = (torch.randn(tokens, head_dim, generator=gen).to(dtype) for _ in range(2))
    want = rotate_half(norm(q), cos, sin)
    got = kernels.head_norm_rope(q, norm.weight, norm.eps, cos, sin)
    if dtype is torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_qwen3_takes_it_and_gives_the_same_logits(tmp_path):
    from checkpoints import hf_qwen3
    from checkpoints.llama import hf_llama
    from oracle import prefill_then_step, world1

    from layer_boundary.fusions.triton_provider import TritonFusions
    from layer_boundary.models import load_model

    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    logits = []
    for fused in (False, True):
        model = load_model(hf_qwen3(tmp_path / "qwen3"), world1())
        if fused:
            model.install_fusion(TritonFusions())
        taken = [layer.self_attn.norm_rope is not None for layer in model.model.layers]
        assert taken == [fused] * len(taken)
        logits.append(prefill_then_step(model, prompts))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
    llama = load_model(hf_llama(tmp_path / "llama"), world1())
    llama.install_fusion(TritonFusions())
    assert all(layer.self_attn.norm_rope is None for layer in llama.model.layers)
