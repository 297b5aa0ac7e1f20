"""Each error of the spec this slice can hit, with its exact text, from real misuse."""

from __future__ import annotations

import pytest
import torch
from toy import HIDDEN, ToyLayer, batch, runtime

from layer_boundary import BatchVariant, ProducerReduction, declare_attn, declare_ffn, make_stages
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime.norm import RMSNorm


def started(fb):
    residual_batch.start(fb)
    return torch.randn(fb.num_tokens, HIDDEN)


def test_prepare_before_start():
    layer, fb = ToyLayer(runtime(), 0, 1), batch()
    with pytest.raises(RuntimeError, match="^start the layer stack before entering a stage$"):
        layer.attn.prepare(torch.randn(3, HIDDEN), fb)


def test_rebound_output_does_not_belong_to_the_stream():
    layer, fb = ToyLayer(runtime(), 0, 2), batch()
    h = layer.forward_layer(started(fb), fb)
    with pytest.raises(RuntimeError, match=(
            "^output does not belong to this residual stream; "
            "change layer outputs through boundary accessors$")):
        residual_batch.norm(h + 0, fb, RMSNorm(HIDDEN))  # a new tensor, not the layer output


def test_output_of_another_microbatch_does_not_belong():
    layer = ToyLayer(runtime(), 0, 2)
    fb_a, fb_b = batch(), batch()
    h_a = layer.attn.prepare(started(fb_a), fb_a)
    h_a = layer.attn.finish(layer.attn_compute(h_a), fb_a)
    h_b = layer.attn.prepare(started(fb_b), fb_b)
    layer.attn.finish(layer.attn_compute(h_b), fb_b)
    with pytest.raises(RuntimeError, match="^output does not belong to this residual stream"):
        layer.ffn.prepare(h_a, fb_b)


def test_take_output_with_pending_update():
    layer, fb = ToyLayer(runtime(), 0, 1), batch()
    h = layer.attn.prepare(started(fb), fb)
    h = layer.attn.finish(layer.attn_compute(h), fb)
    with pytest.raises(RuntimeError,
                       match="^write the residual update before taking the final output$"):
        residual_batch.take_output(h, fb)


@pytest.mark.parametrize("variant", [BatchVariant.CP, BatchVariant.INPUT_SCATTERED,
                                     BatchVariant.SEQUENCE_PARALLEL])
def test_unsupported_batch_variant(variant):
    layer, fb = ToyLayer(runtime(), 0, 1), batch()
    fb.variant = variant
    with pytest.raises(RuntimeError,
                       match=f"^no stage boundary path for the active {variant.value} batch$"):
        layer.attn.prepare(started(fb), fb)


def test_partial_ffn_is_rejected():
    with pytest.raises(ValueError, match="^PARTIAL is not supported for ffn stages$"):
        declare_ffn(reduction=ProducerReduction.PARTIAL)


def test_local_tail_attention_is_rejected():
    with pytest.raises(ValueError, match="^LOCAL_TAIL is not supported for attention stages$"):
        declare_attn(reduction=ProducerReduction.LOCAL_TAIL)


class ScaledUpdate:
    """A nonlinear residual update (as MHC's post operation): may not move before a sum."""

    plain = False
    at_producer = False

    def apply(self, residual, contribution):
        return residual * 0.5 + torch.tanh(contribution)


def test_snapshot_of_a_nonlinear_update():
    layer, fb = ToyLayer(runtime(), 0, 2, ffn_update=ScaledUpdate()), batch()
    h = layer.forward_layer(started(fb), fb)
    with pytest.raises(RuntimeError, match="^snapshot requires a plain residual update$"):
        residual_batch.snapshot(h, fb)


def test_prepared_branch_must_enter_through_branch_input():
    rt = runtime()
    source = declare_ffn()
    (stage,) = make_stages((declare_attn(), RMSNorm(HIDDEN)), prepared_from=source, runtime=rt)
    fb = batch()
    with pytest.raises(RuntimeError,
                       match="^a prepared branch must enter through branch_input, not prepare$"):
        stage.prepare(started(fb), fb)
