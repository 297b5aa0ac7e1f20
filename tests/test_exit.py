"""Exit scopes: the flags compute sees, their restoration, misuse of finish(), and the numbers
of single-stage mixer stacks whose sums move between stages."""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, ToyLayer, batch, local_slice, runtime

from layer_boundary import ProducerReduction, declare_attn, declare_ffn, make_stages
from layer_boundary.output import HandoffOutput
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime.context import get_forward
from layer_boundary.runtime.ledger import LEDGER
from layer_boundary.runtime.linear import RowParallelLinear
from layer_boundary.runtime.norm import RMSNorm


def _through_attention(layer, fb):
    residual_batch.start(fb)
    h = layer.attn.prepare(torch.ones(fb.num_tokens, HIDDEN), fb)
    h = layer.attn.finish(layer.attn_compute(h), fb)
    return layer.ffn.prepare(h, fb)


def flags_case(allreduce_fusion: bool) -> dict:
    rt = runtime(2, allreduce_fusion=allreduce_fusion)
    out = {}
    for terminal in (False, True):
        layer, fb = ToyLayer(rt, 0, 1 if terminal else 2), batch()
        h = _through_attention(layer, fb)
        with layer.ffn.exit(fb) as scope:
            seen = get_forward()
            h = layer.ffn_compute(h)
        out[terminal] = (seen.fuse_mlp_allreduce, scope.fuse_mlp_allreduce,
                         get_forward().fuse_mlp_allreduce)
    return out


@pytest.mark.timeout(60)
def test_ffn_exit_publishes_and_restores_flags():
    for fusion in (True, False):
        for rank_result in get_pool(2).run(flags_case, fusion):
            # (seen inside the scope, exposed by the exit object, seen after the scope)
            assert rank_result[False] == (fusion, fusion, False)
            assert rank_result[True] == (False, False, False)  # terminal: completes in compute


def test_flags_restored_when_compute_raises_and_finish_refuses():
    layer, fb = ToyLayer(runtime(), 0, 2), batch()
    h = _through_attention(layer, fb)
    scope = layer.ffn.exit(fb)
    with pytest.raises(ZeroDivisionError):
        with scope:
            _ = 1 / 0
    assert get_forward().fuse_mlp_allreduce is False
    with pytest.raises(RuntimeError, match="after the exit's computation raised"):
        scope.finish(h)


def test_finish_twice_and_handoff_without_flag():
    layer, fb = ToyLayer(runtime(), 0, 2), batch()
    h = _through_attention(layer, fb)
    with layer.ffn.exit(fb) as scope:
        y = layer.ffn_compute(h)
    scope.finish(y)
    with pytest.raises(RuntimeError, match="finish\\(\\) called twice"):
        scope.finish(y)

    class Handoff(HandoffOutput):
        def complete(self):
            return y

    layer, fb = ToyLayer(runtime(), 0, 2), batch()
    h = _through_attention(layer, fb)
    with layer.ffn.exit(fb) as scope:
        layer.ffn_compute(h)
    with pytest.raises(RuntimeError, match="did not publish defer_moe_finalize"):
        scope.finish(Handoff())


# ---------------------------------------------------------------- single-stage mixer stacks

MIXER = declare_attn(reduction=ProducerReduction.SCOPED, gathers_tp_input=False)
FFN = declare_ffn()
PATTERN = [MIXER, MIXER, FFN, MIXER]  # mixer->mixer, mixer->ffn, ffn->mixer, terminal mixer


def _weight(i: int) -> torch.Tensor:
    return torch.randn(HIDDEN, 2 * HIDDEN, generator=torch.Generator().manual_seed(i)) * 0.2


def mixer_stack(tp: int, allreduce_fusion: bool = True) -> dict:
    """Each stage: y = RowParallelLinear(x repeated twice) under its exit's flags."""
    rt = runtime(tp, allreduce_fusion=allreduce_fusion)
    stages, linears = [], []
    for i, decl in enumerate(PATTERN):
        norm = RMSNorm(HIDDEN)
        with torch.no_grad():
            norm.weight.add_(0.1 * i)
        (stage,) = make_stages(
            (decl, norm), previous=PATTERN[i - 1] if i else None,
            following=PATTERN[i + 1] if i + 1 < len(PATTERN) else None,
            terminal=i == len(PATTERN) - 1, runtime=rt, name=f"s{i}")
        linear = RowParallelLinear(2 * HIDDEN, HIDDEN, rt.parallel.tp_group)
        linear.weight_loader(linear.weight, _weight(i))
        stages.append(stage)
        linears.append(linear)
    fb = batch(4)
    residual_batch.start(fb)
    h = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(99))
    skips = []
    with LEDGER.recording() as ledger:
        for stage, linear in zip(stages, linears):
            h = stage.prepare(h, fb)
            with stage.exit(fb) as scope:
                y = linear(local_slice(h.repeat(1, 2), linear))
            skips.append(scope.skips_reduction)
            h = scope.finish(y)
        out = residual_batch.norm(h, fb, RMSNorm(HIDDEN))
    return {"out": out, "skips": skips, "sites": [e.site for e in ledger]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("allreduce_fusion", [True, False])
def test_mixer_stack_matches_world1(allreduce_fusion):
    ref = mixer_stack(1)
    results = get_pool(2).run(mixer_stack, 2, allreduce_fusion)
    for r in results:
        torch.testing.assert_close(r["out"], ref["out"], atol=1e-5, rtol=0)
        # before an FFN a mixer always leaves its sum; before a mixer only with fusion allowed
        assert r["skips"] == [allreduce_fusion, True, allreduce_fusion, False]
        # one sum per stage output, wherever it ran
        assert len(r["sites"]) == len(PATTERN)
