"""``cached_attention`` (one call per group of requests) against attention written out a
request at a time: repeated K/V heads, an explicit score matrix and fp64 softmax.

Covers decode, equal and ragged prefills, prefills after a cached prefix, chunked queries
(longer than ``attention.CHUNK``), non-consecutive cache slots, a narrower v (MLA), sinks, a
sliding-window ring, a CP share of queries and a padded batch; then that prefill memory is
linear in its length."""

from __future__ import annotations

import pytest
import torch

from layer_boundary.models import attention
from layer_boundary.models.attention import cached_attention
from layer_boundary.models.kv_cache import KVCache
from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode
from torch.utils._python_dispatch import TorchDispatchMode

H, KVH, D = 4, 2, 8


def _reference(history, scaling, sinks=None, window=None):
    """Per request: its whole k/v history [L, KVH, *] and its new queries [n, H, D] at the
    last n positions; returns [n, H, Dv]."""
    outs = []
    for q, k, v in history:
        n, total = q.shape[0], k.shape[0]
        groups = q.shape[1] // k.shape[1]
        k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scaling
        qpos = torch.arange(total - n, total)[:, None]
        kpos = torch.arange(total)[None, :]
        hidden = kpos > qpos
        if window is not None:
            hidden |= kpos <= qpos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            scores = torch.cat((scores, sinks.double()[:, None, None].expand(-1, n, 1)), -1)
        probs = scores.softmax(-1)[..., :total] if sinks is not None else scores.softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs).float()


def _run(steps, *, slots=None, dv=D, sinks=None, window=None, max_len=64, seed=0,
         layer_window=None):
    """``steps``: per forward, the new token count of each request (0: absent). Runs them in
    order on one cache; returns (library out, reference out) of the last forward. ``window``
    makes the cache a ring; ``layer_window`` is a layer's window on a positional cache."""
    torch.manual_seed(seed)
    reqs = len(steps[0])
    slots = slots or list(range(reqs))
    cache = KVCache(1, max(slots) + 1, max_len, KVH, D, torch.float32, v_head_dim=dv,
                    window=window)
    hist_k = [torch.empty(0, KVH, D) for _ in range(reqs)]
    hist_v = [torch.empty(0, KVH, dv) for _ in range(reqs)]
    for counts in steps:
        live = [i for i, n in enumerate(counts) if n]
        prefix = [hist_k[i].shape[0] for i in live]
        batch = ForwardBatch.build(ForwardMode.EXTEND, [[1] * counts[i] for i in live], prefix,
                                   req_slots=[slots[i] for i in live], kv_cache=cache)
        tokens = sum(counts)
        q, k = torch.randn(tokens, H, D), torch.randn(tokens, KVH, D)
        v = torch.randn(tokens, KVH, dv)
        out = cached_attention(0, q, k, v, batch, D ** -0.5, sinks=sinks, window=layer_window)
        history, start = [], 0
        for i in live:
            n = counts[i]
            hist_k[i] = torch.cat((hist_k[i], k[start:start + n]))
            hist_v[i] = torch.cat((hist_v[i], v[start:start + n]))
            history.append((q[start:start + n], hist_k[i], hist_v[i]))
            start += n
    return out, _reference(history, D ** -0.5, sinks, window or layer_window)


CASES = {
    "decode, equal lengths": [[3, 3, 3], [1, 1, 1], [1, 1, 1]],
    "decode, ragged lengths": [[2, 5, 3], [1, 1, 1]],
    "equal prefill": [[6, 6]],
    "ragged prefill": [[6, 2, 6, 3]],
    "prefill after a prefix": [[4, 1, 4], [3, 3, 3]],
    "a request absent": [[4, 3, 2], [1, 0, 2]],
    "chunked queries": [[attention.CHUNK + 37, 5]],
}


@pytest.mark.parametrize("steps", CASES.values(), ids=CASES.keys())
def test_groups_match_one_request_at_a_time(steps):
    max_len = 2 * attention.CHUNK
    out, ref = _run(steps, max_len=max_len)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_non_consecutive_slots_and_a_narrower_value_head():
    out, ref = _run([[3, 5, 2], [1, 1, 1]], slots=[4, 0, 2], dv=D // 2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("steps", [[[3, 5]], [[3, 5], [1, 1]], [[4, 4], [2, 2]]])
def test_sinks(steps):
    sinks = torch.randn(H)
    out, ref = _run(steps, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("steps", [[[5, 2], [1, 1], [1, 1], [1, 1]], [[2, 3], [4, 1], [1, 1]]])
def test_sliding_window_ring(steps):
    out, ref = _run(steps, window=3, max_len=16)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("steps", [*CASES.values(), [[5, 2], [1, 1], [1, 1], [1, 1]]],
                         ids=[*CASES.keys(), "decode past the window"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_a_layer_window_on_a_positional_cache(steps, sinks):
    """A hybrid model's sliding layer: the cache keeps every position, the mask the window."""
    out, ref = _run(steps, layer_window=3, max_len=2 * attention.CHUNK,
                    sinks=torch.randn(H) if sinks else None)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_a_layer_window_refuses_a_ring():
    cache = KVCache(1, 1, 16, KVH, D, torch.float32, window=4)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [[1] * 3], [0], kv_cache=cache)
    q, k = torch.randn(3, H, D), torch.randn(3, KVH, D)
    with pytest.raises(ValueError, match="positional cache; this cache is a ring of 4 rows"):
        cached_attention(0, q, k, k, batch, D ** -0.5, window=2)


@pytest.mark.parametrize("window", [None, 2], ids=["", "layer window"])
def test_a_cp_share_of_queries(window):
    torch.manual_seed(1)
    cache = KVCache(1, 2, 16, KVH, D, torch.float32)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [[1] * 5, [1] * 3], [0, 0], req_slots=[0, 1],
                               kv_cache=cache)
    q, k, v = torch.randn(8, H, D), torch.randn(8, KVH, D), torch.randn(8, KVH, D)
    share = torch.tensor([0, 4, 5, 7])  # token rows of both requests
    out = cached_attention(0, q[share], k, v, batch, D ** -0.5, queries=share, window=window)
    full = _reference([(q[:5], k[:5], v[:5]), (q[5:], k[5:], v[5:])], D ** -0.5, window=window)
    torch.testing.assert_close(out, full[share], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 2], ids=["", "layer window"])
def test_a_padded_batch_matches_the_unpadded_one(window):
    torch.manual_seed(2)
    outs = []
    for pad in (False, True):
        cache = KVCache(1, 3, 16, KVH, D, torch.float32)
        torch.manual_seed(2)
        batch = ForwardBatch.build(ForwardMode.EXTEND, [[1] * 4, [1] * 2], [0, 0],
                                   req_slots=[0, 1], kv_cache=cache)
        q, k, v = torch.randn(6, H, D), torch.randn(6, KVH, D), torch.randn(6, KVH, D)
        if pad:
            batch = batch.padded(8, scratch_slot=2)
            q, k, v = (torch.cat((t, t.new_zeros(2, *t.shape[1:]))) for t in (q, k, v))
        outs.append(cached_attention(0, q, k, v, batch, D ** -0.5, window=window)[:6])
    torch.testing.assert_close(outs[1], outs[0], atol=2e-6, rtol=1e-6)


class _LargestTensor(TorchDispatchMode):
    """The bytes of the largest tensor any op makes (what a score matrix would be)."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _prefill_largest(tokens: int, prefix: int) -> int:
    """One request's prefill of ``tokens`` after ``prefix`` cached ones (0: SDPA's causal
    mask; otherwise an explicit one, chunked)."""
    cache = KVCache(1, 1, prefix + tokens, KVH, D, torch.float32)
    q, k, v = torch.randn(tokens, H, D), torch.randn(tokens, KVH, D), torch.randn(tokens, KVH, D)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [[1] * tokens], [prefix], req_slots=[0],
                               kv_cache=cache)
    with _LargestTensor() as seen:
        cached_attention(0, q, k, v, batch, D ** -0.5)
    return seen.largest


@pytest.mark.parametrize("prefix", [0, 64])
def test_prefill_memory_is_linear_in_its_length(prefix):
    """4x the tokens: at most ~4x the largest tensor (a score matrix would be 16x)."""
    small, large = _prefill_largest(512, prefix), _prefill_largest(2048, prefix)
    assert large <= 5 * small, (small, large)
