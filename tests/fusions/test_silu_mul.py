"""The Triton provider's fused SwiGLU product (``kernels.silu_mul``, under the interpreter
here): ``F.silu(gate) * up`` in one launch (bf16 to the bit, fp32 within rounding) on the two
halves of one projection's rows, each row's numbers its own; a gated MLP takes it from the
provider, and a Llama with the provider gives the logits it gives without."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from layer_boundary.fusions import kernels  # noqa: E402 - after the interpreter is chosen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_silu_then_the_product(dtype):
    gen = torch.Generator().manual_seed(0)
    both = (3 * torch.randn(7, 2 * 48, generator=gen)).to(dtype)
    gate, up = both[:, :48], both[:, 48:]  # strided rows, each contiguous
    want, got = F.silu(gate) * up, kernels.silu_mul(gate, up)
    if dtype is torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    for i in range(7):  # a row's numbers are its own, whatever rows run beside it
        assert torch.equal(kernels.silu_mul(gate[i:i + 1], up[i:i + 1]), got[i:i + 1])
    assert kernels.silu_mul(gate[:0], up[:0]).shape == (0, 48)  # an idle DP rank


def test_a_llama_takes_it_and_gives_the_same_logits(tmp_path):
    from checkpoints.llama import hf_llama
    from oracle import prefill_then_step, world1

    from layer_boundary.fusions.triton_provider import TritonFusions
    from layer_boundary.models import load_model

    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    path = hf_llama(tmp_path / "llama")
    logits = []
    for fused in (False, True):
        model = load_model(path, world1())
        if fused:
            model.install_fusion(TritonFusions())
        taken = [layer.mlp.silu_mul is not None for layer in model.model.layers]
        assert taken == [fused] * len(taken)
        logits.append(prefill_then_step(model, prompts))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def test_a_gated_mlp_with_its_own_forward_takes_nothing():
    """A GELU gate (Gemma-3's) computes through its own forward: it never holds the kernel."""
    from oracle import world1

    from layer_boundary.fusions.triton_provider import TritonFusions
    from layer_boundary.models.gemma3_text import GeluGatedMLP
    from layer_boundary.models.layers import GatedMLP

    provider = TritonFusions()
    plain, gelu = (cls(32, 64, world1(), torch.float32) for cls in (GatedMLP, GeluGatedMLP))
    for mlp in (plain, gelu):
        mlp.take_fusions(provider)
    assert plain.silu_mul is not None and gelu.silu_mul is None
