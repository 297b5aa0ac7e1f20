"""Stage factories: the assembler's checks, and independently built stages that behave like
an assembled pair (same numbers on two gloo ranks as at world 1)."""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, ToyLayer, batch, runtime

from layer_boundary import (declare_attn, declare_ffn, make_attn_stage, make_ffn_stage,
                            make_stages)
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime.norm import RMSNorm


def test_declarations_given_to_make_stages_must_not_carry_their_neighbours():
    with pytest.raises(ValueError, match="must not carry previous, prepared_from or terminal"):
        make_stages((declare_attn(previous=declare_ffn()), RMSNorm(HIDDEN)), runtime=runtime())


def test_stage_options_are_checked_per_kind():
    with pytest.raises(TypeError, match="ffn stages do not accept options \\['qkv_latent_func'\\]"):
        make_stages((declare_ffn(), RMSNorm(HIDDEN), {"qkv_latent_func": abs}), runtime=runtime())


def test_following_must_name_the_stage_as_previous():
    attn = declare_attn()
    with pytest.raises(ValueError, match="must name this stage in its previous field"):
        make_attn_stage(attn, RMSNorm(HIDDEN), following=declare_ffn(), runtime=runtime())


def independent_stages(tp: int) -> torch.Tensor:
    """Layer 1 of a toy stack built stage by stage with make_attn_stage / make_ffn_stage."""
    rt = runtime(tp)
    first = ToyLayer(rt, 0, 2)
    second = ToyLayer(rt, 1, 2)  # its compute and norms; its boundaries are rebuilt below
    attn_decl = declare_attn(previous=declare_ffn())
    ffn_decl = declare_ffn(previous=attn_decl, terminal=True)
    attn = make_attn_stage(attn_decl, second.attn_norm, following=ffn_decl, runtime=rt)
    ffn = make_ffn_stage(ffn_decl, second.ffn_norm, runtime=rt)
    fb = batch(5)
    residual_batch.start(fb)
    h = first.forward_layer(torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1)), fb)
    h = attn.prepare(h, fb)
    h = attn.finish(second.attn_compute(h), fb)
    h = ffn.prepare(h, fb)
    with ffn.exit(fb) as out:
        y = second.ffn_compute(h)
    return residual_batch.norm(out.finish(y), fb, RMSNorm(HIDDEN))


def assembled(tp: int) -> torch.Tensor:
    rt = runtime(tp)
    layers = [ToyLayer(rt, i, 2) for i in range(2)]
    fb = batch(5)
    residual_batch.start(fb)
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    for layer in layers:
        h = layer.forward_layer(h, fb)
    return residual_batch.norm(h, fb, RMSNorm(HIDDEN))


@pytest.mark.timeout(60)
def test_independent_stages_match_assembled_ones():
    ref = assembled(1)
    torch.testing.assert_close(independent_stages(1), ref, atol=1e-6, rtol=0)
    for out in get_pool(2).run(independent_stages, 2):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
