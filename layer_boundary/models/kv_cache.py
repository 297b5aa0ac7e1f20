"""A plain per-request KV cache and the attention that reads it (matches HF eager numerics)."""

from __future__ import annotations

import torch


class KVCache:
    """k/v for ``layers`` (a count, or the global indices a pipeline stage holds): [slots,
    rows, kv_heads, head_dim] each (v may have its own head dim, as MLA's does), indexed by
    the layer's global index.

    ``window`` (sliding-window attention): a query sees only the last ``window`` positions,
    itself included, so the cache keeps ``min(max_len, window)`` rows per request as a ring
    (position p in row p mod rows). ``shared_kv``: one tensor read as both keys and values
    (DeepSeek-V4's K=V attention), stored once.
    """

    # class defaults: a cache that shares another's tensors without running __init__ (such
    # as Nemotron-H's HybridCache) is a full, separate-k/v one
    window: int | None = None
    shared_kv: bool = False

    def __init__(self, layers, slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device="cpu", v_head_dim: int | None = None,
                 window: int | None = None, shared_kv: bool = False) -> None:
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be positive, got {window}")
        rows = max_len if window is None else min(max_len, window)
        k_shape = (slots, rows, kv_heads, head_dim)
        v_shape = (slots, rows, kv_heads, v_head_dim or head_dim)
        layers = range(layers) if isinstance(layers, int) else layers
        self.k = {i: torch.zeros(k_shape, dtype=dtype, device=device) for i in layers}
        self.v = self.k if shared_kv else {i: torch.zeros(v_shape, dtype=dtype, device=device)
                                           for i in layers}
        self.max_len, self.window, self.rows, self.shared_kv = max_len, window, rows, shared_kv

    @property
    def padded_batches(self) -> bool:
        """Whether a padded batch (``ForwardBatch.padded``) runs on this cache: a positional
        one, whose attention reads slots and positions from tensors. A subclass that keeps
        other per-request state declares its own answer (read with ``residual.declared``)."""
        return self.window is None

    @property
    def positional(self) -> bool:
        """Whether entry p holds position p and nothing else: then a later write at p replaces
        a rejected speculative token, and rolling back needs no copy. A windowed ring (row p
        mod window) overwrites older positions instead."""
        return self.window is None

    def snapshot(self):
        """What ``restore`` needs to undo the writes of the forwards in between (None where
        rolling back needs nothing)."""
        if self.positional:
            return None
        return ({i: t.clone() for i, t in self.k.items()},
                None if self.shared_kv else {i: t.clone() for i, t in self.v.items()})

    def restore(self, snapshot) -> None:
        if snapshot is None:
            return
        k, v = snapshot
        for i, t in k.items():
            self.k[i].copy_(t)
        for i, t in (v or {}).items():
            self.v[i].copy_(t)


def cached_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     forward_batch, scaling: float, sinks: torch.Tensor | None = None,
                     queries: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this forward's tokens over each request's cached prefix.

    k: [T, KVH, D], v: [T, KVH, Dv] for the tokens of this forward, requests concatenated;
    q: [T, H, D] for the same tokens, or, with ``queries`` (the token index of each q row,
    request by request: a CP share), for those tokens only. Returns [rows of q, H, Dv].
    Writes k/v into the batch's cache. A windowed cache (``KVCache.window``) limits each
    query to its last ``window`` positions. ``sinks`` [H]: one extra logit per head that
    joins the softmax and is then dropped (attention sinks).
    """
    cache: KVCache = forward_batch.kv_cache
    if forward_batch.token_slots is not None:
        if queries is not None or cache.window is not None:
            raise ValueError("a padded batch takes every token's queries on a positional cache")
        return _slot_attention(cache, layer, q, k, v, forward_batch.token_slots,
                               forward_batch.positions, scaling, sinks)
    num_heads, groups = q.shape[1], q.shape[1] // k.shape[1]
    out = q.new_empty((*q.shape[:2], v.shape[-1]))
    if queries is not None:
        if cache.window is not None:
            raise ValueError("a sliding-window cache takes every token's queries (no CP share)")
        queries = queries.to(q.device)
    start = 0
    for slot, prefix, n in zip(forward_batch.req_slots, forward_batch.prefix_lens,
                               forward_batch.extend_lens):
        end = start + n
        total = prefix + n
        if total > cache.max_len:
            raise ValueError(f"request in slot {slot} needs {total} cache rows; the cache holds "
                             f"{cache.max_len}")
        if cache.window is None:
            cache.k[layer][slot, prefix:total] = k[start:end]
            cache.v[layer][slot, prefix:total] = v[start:end]
            first, keys = 0, cache.k[layer][slot, :total]
            values = cache.v[layer][slot, :total]
        else:
            first, keys, values = _window_keys(cache, layer, slot, prefix, k[start:end],
                                               v[start:end])
        keys = keys.repeat_interleave(groups, dim=1)  # [L, H, D]
        values = values.repeat_interleave(groups, dim=1)
        if queries is None:
            rows = slice(start, end)
            query_pos = torch.arange(prefix, total, device=q.device)
        else:  # this request's rows of the share, at their positions in the request
            lo, hi = (int(i) for i in torch.searchsorted(
                queries, torch.tensor([start, end], device=q.device)))
            rows, query_pos = slice(lo, hi), prefix + queries[lo:hi] - start
        out[rows] = _attend(q[rows], keys, values, query_pos, first, scaling, cache.window,
                            sinks)
        start = end
    assert start == k.shape[0] and num_heads == out.shape[1]
    return out


def _window_keys(cache: KVCache, layer: int, slot: int, prefix: int, k, v):
    """(first key position, keys, values) a windowed request's new queries may see: the ring's
    last ``window - 1`` cached positions, then this forward's. The ring takes the new tokens
    after the read, since they may overwrite rows the read still needs."""
    n, rows = k.shape[0], cache.rows
    first = max(0, prefix - (cache.window - 1))
    past = torch.arange(first, prefix, device=k.device) % rows
    keys = torch.cat((cache.k[layer][slot, past], k))  # [prefix - first + n, KVH, D]
    values = keys if cache.shared_kv else torch.cat((cache.v[layer][slot, past], v))
    keep = min(n, rows)  # only the last ``rows`` new positions can be seen again
    ring = torch.arange(prefix + n - keep, prefix + n, device=k.device) % rows
    cache.k[layer][slot, ring] = k[n - keep:]
    if not cache.shared_kv:
        cache.v[layer][slot, ring] = v[n - keep:]
    return first, keys, values


def _slot_attention(cache: KVCache, layer: int, q, k, v, slots, positions, scaling: float,
                    sinks):
    """A padded batch's attention: every row's k/v is written at (its slot, its position),
    then each query reads its slot's cache rows at positions up to its own. Nothing reads the
    per-request tuples, so the work and the graph depend on the row count alone."""
    keys_of, values_of = cache.k[layer], cache.v[layer]
    keys_of.index_put_((slots, positions), k)
    if not cache.shared_kv:
        values_of.index_put_((slots, positions), v)
    groups = q.shape[1] // k.shape[1]
    keys = keys_of[slots].repeat_interleave(groups, dim=2)  # [T, rows, H, D]
    values = values_of[slots].repeat_interleave(groups, dim=2)  # [T, rows, H, Dv]
    scores = torch.einsum("thd,trhd->htr", q, keys) * scaling  # [H, T, rows]
    later = torch.arange(cache.rows, device=q.device)[None, :] > positions[:, None]  # [T, rows]
    probs = _softmax(scores.masked_fill(later, torch.finfo(scores.dtype).min), sinks, q.dtype)
    return torch.einsum("htr,trhd->thd", probs, values)


def _softmax(scores, sinks, dtype):
    """Softmax over the last dim in fp32; ``sinks`` [H]: one extra logit per head that joins
    each row's softmax and then leaves (its rows sum to less than one)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    sink = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:2], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)
    return probs[..., :-1].to(dtype)


def _attend(q, keys, values, query_pos, first: int, scaling: float, window, sinks):
    """q [n, H, D] at positions ``query_pos`` [n] over keys/values [L, H, *] at positions
    first.."""
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scaling  # [H, n, L]
    query_pos = query_pos[:, None]
    key_pos = torch.arange(first, first + keys.shape[0], device=q.device)[None, :]
    hidden = key_pos > query_pos
    if window is not None:
        hidden = hidden | (key_pos <= query_pos - window)
    probs = _softmax(scores.masked_fill(hidden, torch.finfo(scores.dtype).min), sinks, q.dtype)
    return torch.einsum("hqk,khd->qhd", probs, values)
