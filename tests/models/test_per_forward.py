"""What a forward's layers compute once and share (``residual.batch.per_forward``): the rotary
cos/sin of its positions and the attention's request groups. Counted per forward, and the
logits compared bit for bit with every layer computing its own."""

from __future__ import annotations

import pytest
import torch

from layer_boundary.engine.bench import _random_model
from layer_boundary.models import attention, rope
from layer_boundary.models.qwen3 import Qwen3Config
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode, TwoBatch

LAYERS = 3


@pytest.fixture(scope="module")
def model():
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16)
    return _random_model(cfg)


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _forwards(model, two_batch=TwoBatch.NONE):
    """A ragged prefill then a decode step of three requests; their logits."""
    cache = model.make_kv_cache(3, 16)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    prefill = ForwardBatch.build(ForwardMode.EXTEND, prompts, [0, 0, 0], kv_cache=cache)
    prefill.two_batch = two_batch
    if two_batch.splits:
        prefill.dp_request_lens = (prefill.extend_lens,)
    out = [model(prefill)]
    decode = ForwardBatch.build(ForwardMode.DECODE, [[1], [2], [3]], [4, 2, 3], kv_cache=cache)
    out.append(model(decode))
    return out, (prefill, decode)


@torch.no_grad()
@pytest.mark.parametrize("two_batch", [TwoBatch.NONE, TwoBatch.OVERLAPPED],
                         ids=["one batch", "two microbatches"])
def test_each_forward_computes_its_rotary_table_and_groups_once(model, monkeypatch, two_batch):
    tables = _counting(monkeypatch, rope, "rope_cos_sin")
    groups = _counting(monkeypatch, attention, "_groups")
    shared, batches = _forwards(model, two_batch)
    forwards = 3 if two_batch.splits else 2  # a split prefill is two forwards, then a decode
    assert len(tables) == len(groups) == forwards
    for fb in batches:  # gone with the forward: nothing held after the stack left
        assert fb.boundary.stream is None and fb.boundary.memo == {}

    tables.clear()
    monkeypatch.setattr(ForwardBatch, "per_forward", lambda fb, key, compute: compute())
    own, _ = _forwards(model, two_batch)
    assert len(tables) == LAYERS * forwards  # every layer its own, as before the memo
    for a, b in zip(shared, own):
        assert torch.equal(a, b)


@torch.no_grad()
def test_a_table_is_reused_only_for_the_forwards_own_positions(model):
    fb = ForwardBatch.build(ForwardMode.EXTEND, [[1, 2, 3]], [0])
    layer = model.model.layers[0].self_attn
    key, inv_freq = layer.rope_key, layer.inv_freq
    # outside a stack: nothing is kept, each call computes
    assert fb.boundary is None
    cos, _ = rope.forward_cos_sin(fb, key, fb.positions, inv_freq, torch.float32)
    again, _ = rope.forward_cos_sin(fb, key, fb.positions, inv_freq, torch.float32)
    assert again is not cos and torch.equal(again, cos)
    residual_batch.start(fb)
    cos, sin = rope.forward_cos_sin(fb, key, fb.positions, inv_freq, torch.float32)
    assert rope.forward_cos_sin(fb, key, fb.positions, inv_freq, torch.float32)[0] is cos
    other = fb.positions + 5  # a layer handed other positions gets their own table
    moved, _ = rope.forward_cos_sin(fb, key, other, inv_freq, torch.float32)
    expect, _ = rope.rope_cos_sin(other, inv_freq, torch.float32)
    assert torch.equal(moved, torch.cat((expect, expect), dim=-1))
    # other frequencies are another table
    assert rope.forward_cos_sin(fb, rope.rope_key(inv_freq * 2), fb.positions, inv_freq * 2,
                                torch.float32)[0] is not cos
    assert rope.rope_key(inv_freq) == key != rope.rope_key(inv_freq * 2)


@torch.no_grad()
@pytest.mark.parametrize("model_type", ["qwen3_next", "deepseek_v3", "deepseek_v4"])
def test_partial_and_mla_rotary_is_one_table_per_forward(model_type, monkeypatch):
    """Qwen3-Next's partial rotary and the MLA models' rotary key and queries: one table a
    forward, the same logits as every layer computing its own."""
    from model_configs import config

    from layer_boundary.runtime import BoundaryRuntime, ParallelDims
    from layer_boundary.runtime.parallel import build_parallel

    model_cls, cfg = config(model_type)
    torch.manual_seed(0)
    net = model_cls(cfg, BoundaryRuntime(build_parallel(ParallelDims()),
                                         boundary_reduction="ar")).eval()
    for name, p in net.named_parameters():
        p.copy_(1 + 0.1 * torch.randn(p.shape) if "norm" in name else torch.randn(p.shape) * 0.05)

    def prefill():
        fb = ForwardBatch.build(ForwardMode.EXTEND, [[1, 2, 3], [4, 5]], [0, 0],
                                kv_cache=net.make_kv_cache(2, 8))
        return net(fb)

    tables = _counting(monkeypatch, rope, "rope_cos_sin")
    shared = prefill()
    assert len(tables) == 1
    tables.clear()
    monkeypatch.setattr(ForwardBatch, "per_forward", lambda fb, key, compute: compute())
    assert torch.equal(prefill(), shared)
    assert len(tables) > 1  # each attention layer its own (and each of its q and k)
