"""A plain per-request KV cache and the attention that reads it (matches HF eager numerics)."""

from __future__ import annotations

import torch


class KVCache:
    """k/v for ``num_layers`` layers: [slots, max_len, kv_heads, head_dim] each (v may have its
    own head dim, as MLA's does)."""

    def __init__(self, num_layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device="cpu", v_head_dim: int | None = None) -> None:
        k_shape = (slots, max_len, kv_heads, head_dim)
        v_shape = (slots, max_len, kv_heads, v_head_dim or head_dim)
        self.k = [torch.zeros(k_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len


def cached_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     forward_batch, scaling: float) -> torch.Tensor:
    """Causal attention of this forward's tokens over each request's cached prefix.

    q: [T, H, D], k: [T, KVH, D], v: [T, KVH, Dv] for the tokens of this forward, requests
    concatenated. Returns [T, H, Dv]. Writes k/v into the batch's cache first.
    """
    cache: KVCache = forward_batch.kv_cache
    num_heads, groups = q.shape[1], q.shape[1] // k.shape[1]
    out = q.new_empty((*q.shape[:2], v.shape[-1]))
    start = 0
    for slot, prefix, n in zip(forward_batch.req_slots, forward_batch.prefix_lens,
                               forward_batch.extend_lens):
        end = start + n
        total = prefix + n
        if total > cache.max_len:
            raise ValueError(f"request in slot {slot} needs {total} cache rows; the cache holds "
                             f"{cache.max_len}")
        cache.k[layer][slot, prefix:total] = k[start:end]
        cache.v[layer][slot, prefix:total] = v[start:end]
        keys = cache.k[layer][slot, :total].repeat_interleave(groups, dim=1)  # [L, H, D]
        values = cache.v[layer][slot, :total].repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * scaling  # [H, n, L]
        query_pos = torch.arange(prefix, total, device=q.device)[:, None]
        key_pos = torch.arange(total, device=q.device)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values)
        start = end
    assert start == q.shape[0] and num_heads == out.shape[1]
    return out
