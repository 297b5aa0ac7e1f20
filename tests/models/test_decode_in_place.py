"""Decode attention in place (``models/decode_kernel.py``, Triton under the interpreter here):
each request's keys and values read from its own slot up to its own length. It matches the
gathering path for every attention variant models use (GQA, a layer's window on a positional
cache, a sliding-window ring, sinks, a softcap, a value head narrower than the key's, one
tensor for keys and values); a padded decode step through it makes no tensor the size of the
cached keys, where the gathering path makes one per layer; a model's padded decode step gives
the same logits either way; the Triton provider's caches decode in place (a ring too). The
count of a layer's ops in place against gathering: tests/test_bench.py (kernel_count)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from layer_boundary.models.attention import cached_attention
from layer_boundary.models.kv_cache import KVCache
from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode

H, KVH, D, MAX_LEN = 8, 2, 16, 256  # a slot far longer than the prompts, as a server's
PROMPTS = (7, 3, 12)  # ragged: each request reads its own length

VARIANTS = {
    "gqa": {},
    "layer window": dict(layer_window=4),
    "sinks": dict(sinks=True),
    "softcap": dict(softcap=2.5),
    "narrow values": dict(dv=8),
    "keys are values": dict(shared_kv=True),
    # MLA's absorbed form (DeepSeek-V3): one latent head, each value its key's first dims
    "latent": dict(kvh=1, dv=8, values_from_keys=8),
}


def _step(in_place: bool, *, layer_window=None, sinks=False, softcap=None, dv=D,
          shared_kv=False, ring=None, padded=True, watch=None, kvh=KVH, values_from_keys=None):
    """A prefill of ``PROMPTS`` then one decode step (padded to 4 rows, the padding row in a
    scratch slot), on a fresh cache: the decode step's attention output (``watch``: a
    context around the decode step's attention alone)."""
    torch.manual_seed(0)
    cache = KVCache(1, len(PROMPTS) + 1, MAX_LEN, kvh, D, torch.float32, v_head_dim=dv,
                    window=ring, shared_kv=shared_kv, values_from_keys=values_from_keys)
    cache.decode_in_place = in_place
    head_sinks = torch.randn(H) if sinks else None
    kwargs = dict(sinks=head_sinks, softcap=softcap, window=layer_window)

    def attend(batch, tokens):
        q, k, v = torch.randn(tokens, H, D), torch.randn(tokens, kvh, D), torch.randn(tokens,
                                                                                        kvh, dv)
        return cached_attention(0, q, k, v, batch, D ** -0.5, **kwargs)

    prefill = ForwardBatch.build(ForwardMode.EXTEND, [[1] * n for n in PROMPTS],
                                 [0] * len(PROMPTS), kv_cache=cache)
    attend(prefill, sum(PROMPTS))
    decode = ForwardBatch.build(ForwardMode.DECODE, [[1]] * len(PROMPTS), list(PROMPTS),
                                kv_cache=cache)
    rows = len(PROMPTS) + padded
    if padded:
        decode = decode.padded(rows, scratch_slot=len(PROMPTS))
    q, k, v = torch.randn(rows, H, D), torch.randn(rows, kvh, D), torch.randn(rows, kvh, dv)
    with watch or contextlib.nullcontext():
        out = cached_attention(0, q, k, v, decode, D ** -0.5, **kwargs)
    return out[:len(PROMPTS)]


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_a_padded_decode_step_matches_the_gathering_path(variant):
    torch.testing.assert_close(_step(True, **variant), _step(False, **variant), atol=2e-6,
                               rtol=1e-5)


@pytest.mark.parametrize("window", [5, 64], ids=["ring shorter than prompts", "ring longer"])
def test_a_ring_decode_step_matches_the_gathering_path(window):
    """A sliding-window ring (position p in row p mod rows) decodes its requests unpadded."""
    torch.testing.assert_close(_step(True, ring=window, padded=False),
                               _step(False, ring=window, padded=False), atol=2e-6, rtol=1e-5)


class _Made(TorchDispatchMode):
    """The element counts of every tensor the ops inside it make, a kernel launch's own work
    aside (``paused``: on the CPU the Triton interpreter copies a launch's arguments in and
    out, which a compiled kernel on a GPU does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # an output that aliases an input (a view, or an in-place write's ``self``) is no new
        # tensor
        made = [r.alias_info is None for r in func._schema.returns]
        for t, new in zip(out if isinstance(out, (tuple, list)) else (out,), made):
            if isinstance(t, torch.Tensor) and new and not self.paused:
                self.sizes.append(t.numel())
        return out


@pytest.mark.parametrize("in_place", [True, False])
def test_a_padded_decode_step_copies_no_cache(in_place, monkeypatch):
    """Gathering makes [rows, KVH, MAX_LEN, D] per step (what the test would find); in place,
    nothing the step makes comes near one request's slot of keys."""
    from layer_boundary.models import decode_kernel

    slot = KVH * MAX_LEN * D
    made, launch, launches = _Made(), decode_kernel.launch, []

    def counted(*args, **meta):
        launches.append(args[0])
        made.paused = True
        try:
            launch(*args, **meta)
        finally:
            made.paused = False

    monkeypatch.setattr(decode_kernel, "launch", counted)
    _step(in_place, watch=made)
    assert len(launches) == 3 * in_place  # the cache write, the splits, their merge
    largest = max(made.sizes)
    if in_place:
        assert largest < slot, largest
    else:
        assert largest >= (len(PROMPTS) + 1) * slot, largest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["own values", "keys are values", "latent"])
def test_the_cache_write_is_the_two_index_writes(dtype, layout):
    """``store_kv``'s one launch leaves the cache as ``k`` then ``v`` written by index (a
    latent's values over its keys' first dims), bit for bit."""
    from layer_boundary.models.decode_kernel import store_kv

    kvh, dv = (1, 8) if layout == "latent" else (KVH, D)
    caches = []
    for fused in (True, False):
        torch.manual_seed(0)
        cache = KVCache(1, 4, 32, kvh, D, dtype, v_head_dim=dv,
                        shared_kv=layout == "keys are values",
                        values_from_keys=dv if layout == "latent" else None)
        k, v = torch.randn(3, kvh, D).to(dtype), torch.randn(3, kvh, dv).to(dtype)
        slots, rows = torch.tensor([2, 0, 3]), torch.tensor([5, 31, 0])
        if fused:
            store_kv(cache.k[0], None if cache.shared_kv else cache.v[0], slots, rows, k, v)
        else:
            cache.k[0][slots, :, rows] = k
            if not cache.shared_kv:
                cache.v[0][slots, :, rows] = v
        caches.append((cache.k[0].clone(), cache.v[0].clone()))
    for fused, indexed in zip(*caches):
        assert torch.equal(fused, indexed) and fused.abs().sum() > 0


def test_the_triton_provider_makes_the_caches_decode_in_place(qwen3_dir):
    """A provider declares the in-place decode attention (the Triton one does, the reference
    one does not); the caches a model makes after it is installed follow it."""
    from oracle import world1

    from layer_boundary.fusions.reference import ReferenceFusions
    from layer_boundary.fusions.triton_provider import TritonFusions
    from layer_boundary.models import load_model

    made = []
    for provider in (None, ReferenceFusions(), TritonFusions()):
        model = load_model(qwen3_dir, world1())
        if provider is not None:
            model.install_fusion(provider)
        made.append(model.make_kv_cache(2, 8).decode_in_place)
    assert made == [False, False, True]


def test_a_model_decodes_the_same_logits_in_place(tmp_path):
    """A tiny Qwen3's padded decode step through every layer: the same logits either way."""
    from checkpoints import hf_qwen3
    from oracle import world1

    from layer_boundary.models import load_model

    model = load_model(hf_qwen3(tmp_path / "qwen3"), world1())
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    logits = []
    for in_place in (False, True):
        cache = model.make_kv_cache(len(prompts) + 1, 16)
        cache.decode_in_place = in_place
        with torch.no_grad():
            model(ForwardBatch.build(ForwardMode.EXTEND, prompts, [0] * 3, kv_cache=cache))
            step = ForwardBatch.build(ForwardMode.DECODE, [[7], [8], [9]],
                                      [len(p) for p in prompts], kv_cache=cache)
            logits.append(model(step.padded(4, scratch_slot=3))[:3])
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def test_a_mistral_with_the_triton_provider_decodes_its_ring_in_place(tmp_path):
    """A sliding-window ring (Mistral's cache) decodes unpadded through the in-place path
    once the Triton provider is installed: its greedy steps, past the ring's wrap, give the
    logits and tokens of the model without a provider."""
    from checkpoints.llama import hf_mistral
    from oracle import world1

    from layer_boundary.engine.generate import greedy_generate
    from layer_boundary.fusions.triton_provider import TritonFusions
    from layer_boundary.models import load_model

    path = hf_mistral(tmp_path / "mistral", sliding_window=4)
    prompts = [[3, 1, 4, 1, 5, 9], [2, 6]]  # the first past its ring of 4 rows already
    runs = []
    for fused in (False, True):
        model = load_model(path, world1())
        if fused:
            model.install_fusion(TritonFusions())
        assert model.make_kv_cache(1, 8).decode_in_place is fused
        with torch.no_grad():
            runs.append(greedy_generate(model, prompts, 3, keep_logits=True))
    assert runs[1].generated == runs[0].generated
    for ours, plain in zip(runs[1].logits, runs[0].logits):
        for a, b in zip(ours, plain):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_rank_with_no_rows_writes_nothing_and_attends_to_nothing():
    """An idle attention-DP rank's decode step (a ring's unpadded step can have no rows):
    the write launches nothing and the attention returns its empty output."""
    pytest.importorskip("triton")
    from layer_boundary.models import decode_kernel

    k_cache, v_cache = torch.randn(2, KVH, 8, D), torch.randn(2, KVH, 8, D)
    before = (k_cache.clone(), v_cache.clone())
    none = torch.zeros(0, dtype=torch.long)
    decode_kernel.store_kv(k_cache, v_cache, none, none, torch.zeros(0, KVH, D),
                           torch.zeros(0, KVH, D))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    out = decode_kernel.decode_attention(torch.zeros(0, H, D), k_cache, v_cache, none, none,
                                         D ** -0.5, window=4, ring=True)
    assert out.shape == (0, H, D)
