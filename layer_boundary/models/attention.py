"""Attention over the KV cache, one call per group of requests rather than one per request.

Every model's attention reads the cache through ``cached_attention``. The batch's requests
are grouped by how many query rows they bring (a decode step, or a prefill of equal
prompts, is one group), and each group runs as one ``scaled_dot_product_attention`` over
[requests, heads, rows, head_dim]:

* grouped-query heads are read with ``enable_gqa``, so K/V are never repeated per head;
* keys are the cache rows themselves (a view when the group's slots are consecutive), and
  the mask hides each query's later positions, which also hides a shorter request's padding;
* torch's CPU flash kernel (and the CUDA ones) computes blockwise, so the score matrix is
  never materialised: memory is linear in the prefill length. Where the mask is explicit,
  queries run in chunks of ``CHUNK`` rows so the mask is linear too;
* v with a narrower head than q/k (MLA) is zero-padded to q's width so the flash kernel
  still applies (padding columns come out zero and are dropped).

Attention sinks (one extra logit per head that joins the softmax) have no SDPA form, so that
case runs the same grouping through explicit fp32 softmax math, still without repeating K/V.
A sliding-window cache is a ring: decode reads the whole ring with each row's position
recovered, prefill and CP shares (queries at scattered positions) run a request at a time.

Planning reads the per-request tuples only (Python ints), never tensor sizes, so a compiled
forward with automatic dynamic shapes does not branch on symbolic sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..runtime.invariant import BATCH_INVARIANT

CHUNK = 512  # query rows per masked call: the mask and any fallback scores stay O(rows x keys)


@dataclass(frozen=True)
class _Group:
    """Requests of one forward that bring the same number of query rows (made once per
    forward: every layer's attention reads the same groups)."""

    rows: int  # query rows (new tokens) of each
    slots: tuple[int, ...]
    prefixes: tuple[int, ...]
    firsts: tuple[int, ...]  # each request's first token row in this forward
    keys: int  # cache rows the group reads: its longest request's
    contiguous: bool  # its tokens are one run of the batch, request after request (a view)
    uniform: bool  # every request has the same prefix: each query sees the same key count


def _group(rows: int, slots: tuple, prefixes: tuple, firsts: tuple) -> _Group:
    longest = 0
    for p in prefixes:
        longest = p if p > longest else longest
    return _Group(rows, slots, prefixes, firsts, longest + rows,
                  all(f == firsts[0] + i * rows for i, f in enumerate(firsts)),
                  all(p == prefixes[0] for p in prefixes))


def _groups(forward_batch) -> list[_Group]:
    # a list, not a dict keyed by row count: under automatic dynamic shapes the counts may
    # be symbolic, and comparing them is what dynamo can guard
    by_rows: list[tuple[int, list]] = []
    alone = BATCH_INVARIANT.on  # a request a call: its shapes never depend on the batch
    for r in forward_batch.requests():
        if r.extend == 0:
            continue
        for rows, reqs in by_rows:
            if rows == r.extend and not alone:
                reqs.append(r)
                break
        else:
            by_rows.append((r.extend, [r]))
    return [_group(n, tuple(r.slot for r in reqs), tuple(r.prefix for r in reqs),
                   tuple(r.start for r in reqs))
            for n, reqs in by_rows]


def cached_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     forward_batch, scaling: float, sinks: torch.Tensor | None = None,
                     queries: torch.Tensor | None = None,
                     window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of this forward's tokens over each request's cached prefix; writes
    this forward's k/v into the batch's cache (``forward_batch.kv_cache``).

    Args:
        layer: the layer's global index in the cache.
        q: [T, H, D] for this forward's tokens, requests concatenated; with ``queries``, the
            rows of a CP share only.
        k, v: [T, KVH, D] and [T, KVH, Dv] for every token of the forward (H a multiple of
            KVH: grouped-query heads).
        forward_batch: the batch (its per-request tuples, or a padded batch's token slots).
        scaling: the softmax scale.
        sinks: [H], one extra logit per head that joins the softmax and is then dropped.
        queries: the token index of each q row, request by request (a CP share); keys are
            masked by the query's own position.
        window: this layer's sliding window on a positional cache (a hybrid model's sliding
            layers: a query sees its last ``window`` positions, itself included); the cache
            keeps every position, the mask hides the older ones. None: every position.
        softcap: each scaled score s becomes softcap * tanh(s / softcap) before the mask
            (Gemma 2's attention); None: none.

    Returns:
        [rows of q, H, Dv].
    """
    cache = forward_batch.kv_cache
    scores = None if sinks is None and softcap is None else Scores(sinks, softcap)
    if window is not None and cache.window is not None:
        raise ValueError("a layer's sliding window reads a positional cache; this cache is a "
                         f"ring of {cache.window} rows")
    if forward_batch.token_slots is not None:
        if queries is not None or cache.window is not None:
            raise ValueError("a padded batch takes every token's queries on a positional cache")
        return _slot_attention(cache, layer, q, k, v, forward_batch, scaling, scores, window)
    for slot, total in zip(forward_batch.req_slots, forward_batch.seq_lens):
        if total > cache.max_len:
            raise ValueError(f"request in slot {slot} needs {total} cache rows; the cache holds "
                             f"{cache.max_len}")
    if queries is not None:
        if cache.window is not None:
            raise ValueError("a sliding-window cache takes every token's queries (no CP share)")
        return _share_attention(cache, layer, q, k, v, forward_batch, scaling, scores, queries,
                                window)
    if cache.window is not None:
        return _ring_attention(cache, layer, q, k, v, forward_batch, scaling, scores)
    groups = forward_batch.per_forward("attention groups", lambda: _groups(forward_batch))
    if len(groups) == 1 and groups[0].contiguous:  # a decode step, equal prompts: no gather
        g = groups[0]
        return _group_attention(cache, layer, g, q.view(len(g.slots), g.rows, *q.shape[1:]),
                                k.view(len(g.slots), g.rows, *k.shape[1:]),
                                v.view(len(g.slots), g.rows, *v.shape[1:]), scaling,
                                scores, window).flatten(0, 1)
    out = q.new_empty((*q.shape[:2], v.shape[-1]))
    for g in groups:
        rows = _rows(g, q.device)  # [b, n] token rows
        out[rows] = _group_attention(cache, layer, g, q[rows], k[rows], v[rows], scaling, scores,
                                     window)
    return out


def _rows(g: _Group, device) -> torch.Tensor:
    return torch.tensor([[f + i for i in range(g.rows)] for f in g.firsts], dtype=torch.long,
                        device=device)


def slot_index(slots: tuple[int, ...], device):
    """Index of cache (or state) rows ``slots``: a slice where they are consecutive (a view),
    else an index tensor (a gather: write back through ``rows[index] = ...``)."""
    if all(s == slots[0] + i for i, s in enumerate(slots)):
        return slice(slots[0], slots[0] + len(slots))
    return torch.tensor(slots, dtype=torch.long, device=device)


def _group_attention(cache, layer: int, g: _Group, q, k, v, scaling: float, scores,
                     window=None):
    """One group: q [b, n, H, D], k/v [b, n, KVH, *] its new tokens. Writes them at their
    positions in the group's slots, then attends over the cache rows [0, longest) (the last
    ``window`` positions of each query, where a window is given)."""
    b, n, keys = len(g.slots), g.rows, g.keys
    device = q.device
    slots = slot_index(g.slots, device)
    # SDPA's own causal mask is exact for equal prompts with no prefix (query i sees keys
    # 0..i, n == L): the flash kernel runs it blockwise with no mask at all
    causal = g.uniform and g.prefixes[0] == 0 and n > 1 and scores is None
    # every key is seen, or SDPA masks: no positions (unless a window hides some of ``keys``)
    if (window is None or window >= keys) and ((g.uniform and n == 1) or causal):
        query_pos = None
    else:  # each new token's position, [b, n]: where it is written and what it may see
        query_pos = torch.tensor(g.prefixes, dtype=torch.long, device=device)[:, None] \
            + torch.arange(n, device=device)
    if g.uniform:
        p = g.prefixes[0]
        cache.k[layer][slots, :, p:p + n] = k.transpose(1, 2)  # [b, KVH, n, D]
        if not cache.shared_kv:
            cache.v[layer][slots, :, p:p + n] = v.transpose(1, 2)
    else:
        rows = slots if isinstance(slots, torch.Tensor) else torch.arange(
            slots.start, slots.stop, device=device)
        # the two index tensors [b, n] select (request, position); each pair takes [KVH, D]
        requests = rows[:, None].expand(b, n)
        cache.k[layer][requests, :, query_pos] = k
        if not cache.shared_kv:
            cache.v[layer][requests, :, query_pos] = v
    key_rows = cache.k[layer][slots, :, :keys]  # [b, KVH, L, D] (a view for consecutive slots)
    value_rows = key_rows if cache.shared_kv else cache.v[layer][slots, :, :keys]
    if query_pos is None:
        return _attend_chunk(q, key_rows, value_rows, None, None, scaling, scores, causal, None)
    return _attend(q, key_rows, value_rows, query_pos, torch.arange(keys, device=device),
                   scaling, scores, window=window)


def _attend(q, keys, values, query_pos, key_pos, scaling: float, scores, *, window):
    """q [b, n, H, D] over keys [b, KVH, L, D] / values [b, KVH, L, Dv] (the cache's
    head-major layout) -> [b, n, H, Dv].

    query_pos [b, n] and key_pos [L] or [b, L] (negative: an empty row) give the mask: a
    query sees keys at positions <= its own (and > its own - ``window``)."""
    n = q.shape[1]
    if n <= CHUNK:
        return _attend_chunk(q, keys, values, query_pos, key_pos, scaling, scores, False, window)
    # chunks of queries: the mask (and the sink path's scores) stay [chunk, keys]
    parts = []
    for lo in range(0, n, CHUNK):
        hi = lo + CHUNK if lo + CHUNK < n else n
        parts.append(_attend_chunk(q[:, lo:hi], keys, values, query_pos[:, lo:hi], key_pos,
                                   scaling, scores, False, window))
    return torch.cat(parts, dim=1)


def _attend_chunk(q, keys, values, query_pos, key_pos, scaling, scores, causal, window):
    """``_attend`` in one call; query_pos None (and not ``causal``): every key is seen."""
    mask = None
    if query_pos is not None:
        key_pos = key_pos[:, None, :] if key_pos.dim() == 2 else key_pos[None, None, :]
        seen = (key_pos <= query_pos[:, :, None]) & (key_pos >= 0)  # [b, n, L]
        if window is not None:
            seen = seen & (key_pos > query_pos[:, :, None] - window)
        mask = seen[:, None]  # [b, 1, n, L], one mask for every head
    q4, k4, v4 = q.transpose(1, 2), keys, values  # [b, h, *, d]
    if scores is not None:
        out = _sink_attention(q4, k4, v4, mask, scaling, scores)
    else:
        dv = v4.shape[-1]
        if dv < q4.shape[-1]:  # MLA: pad v to q's head dim, the flash kernel's requirement
            v4 = F.pad(v4, (0, q4.shape[-1] - dv))
        b, heads, n, d = q4.shape
        kv_heads = k4.shape[1]
        if n == 1 and heads > kv_heads:
            # one query a request (decode): the heads sharing a kv head are the rows of one
            # query block over it, the same products with K/V read once per kv head rather
            # than once per query head (a request's mask [b, 1, 1, L] holds for every row)
            out = F.scaled_dot_product_attention(
                q4.reshape(b, kv_heads, heads // kv_heads, d), k4, v4, attn_mask=mask,
                scale=scaling).reshape(b, heads, 1, -1)[..., :dv]
        else:
            out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=causal,
                                                 scale=scaling, enable_gqa=True)[..., :dv]
    return out.transpose(1, 2)  # [b, n, H, Dv]


@dataclass(frozen=True)
class Scores:
    """What changes attention scores beyond SDPA's arithmetic (it then runs as explicit fp32
    softmax math): ``softcap`` (each scaled score s becomes cap * tanh(s / cap), Gemma 2's)
    and ``sinks`` ([H]: one extra logit per head that joins the softmax and is dropped)."""

    sinks: torch.Tensor | None = None
    softcap: float | None = None


def _sink_attention(q4, k4, v4, mask, scaling: float, scores: Scores):
    """SDPA's arithmetic with ``scores``' changes, without repeating K/V: q4 [b, H, n, D] is
    read as [b, KVH, H/KVH, n, D]."""
    b, heads, n, d = q4.shape
    kv_heads = k4.shape[1]
    qg = q4.reshape(b, kv_heads, heads // kv_heads, n, d)
    logits = torch.einsum("bkgnd,bkld->bkgnl", qg, k4) * scaling  # [b, KVH, G, n, L]
    if scores.softcap is not None:
        logits = torch.tanh(logits / scores.softcap) * scores.softcap
    if mask is not None:
        logits = logits.masked_fill(~mask[:, :, None], torch.finfo(logits.dtype).min)
    if scores.sinks is not None:
        sink = scores.sinks.to(logits.dtype).view(1, kv_heads, heads // kv_heads, 1, 1).expand(
            b, kv_heads, heads // kv_heads, n, 1)
        probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1, dtype=torch.float32)
        probs = probs[..., :-1].to(q4.dtype)
    else:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q4.dtype)
    out = torch.einsum("bkgnl,bkle->bkgne", probs, v4)
    return out.reshape(b, heads, n, v4.shape[-1])


def _slot_attention(cache, layer: int, q, k, v, forward_batch, scaling: float, scores,
                    window=None):
    """A padded batch: each row's k/v is written at (its slot, its position), then every row
    is its own one-query request over its slot's cache rows. Nothing reads the per-request
    tuples, so the work and the graph depend on the row count alone."""
    slots, positions = forward_batch.token_slots, forward_batch.positions
    if cache.decode_in_place:  # each row reads its own slot up to its length, no copy
        return _in_place(cache, layer, q, k, v, slots, positions, positions, scaling, scores,
                         window)
    cache.k[layer][slots, :, positions] = k  # each (slot, position) pair takes [KVH, D]
    if not cache.shared_kv:
        cache.v[layer][slots, :, positions] = v
    keys = cache.k[layer][slots]  # [T, KVH, rows, D]
    values = keys if cache.shared_kv else cache.v[layer][slots]
    key_pos = torch.arange(cache.rows, device=q.device)
    return _attend_chunk(q[:, None], keys, values, positions[:, None], key_pos, scaling, scores,
                         False, window)[:, 0]


def _in_place(cache, layer: int, q, k, v, slots, rows, positions, scaling: float, scores,
              window, ring: bool = False):
    """Each row's new key and value written at (its slot, its cache row ``rows``), one launch
    (``decode_kernel.store_kv``); then one query row a request over its own slot up to its
    position, read where it lies (``decode_kernel.decode_attention``)."""
    from .decode_kernel import decode_attention, store_kv

    store_kv(cache.k[layer], None if cache.shared_kv else cache.v[layer], slots, rows, k, v)
    return decode_attention(q, cache.k[layer], cache.v[layer], slots, positions + 1, scaling,
                            window=window, ring=ring,
                            sinks=None if scores is None else scores.sinks,
                            softcap=None if scores is None else scores.softcap)


def _ring_attention(cache, layer: int, q, k, v, forward_batch, scaling: float, scores):
    """A sliding-window ring. Decode (one row a request) writes, then reads the whole ring,
    each row's position recovered from the request's length; a prefill runs a request at a
    time, reading the ring before the new rows overwrite what it still needs. Batch-invariant,
    a decode step runs a request at a time too: the whole ring's row count follows the batch's
    longest prompt (``min(max_len, window)``), a request's own keys do not."""
    if all(n == 1 for n in forward_batch.extend_lens) and not BATCH_INVARIANT.on:
        device, rows = q.device, cache.rows
        slots = torch.tensor(forward_batch.req_slots, dtype=torch.long, device=device)
        positions = forward_batch.positions  # [B], one per request
        ring = positions % rows
        if cache.decode_in_place:
            return _in_place(cache, layer, q, k, v, slots, ring, positions, scaling, scores,
                             cache.window, ring=True)
        cache.k[layer][slots, :, ring] = k  # each (slot, ring row) pair takes [KVH, D]
        if not cache.shared_kv:
            cache.v[layer][slots, :, ring] = v
        keys = cache.k[layer][slots]  # [B, KVH, rows, D]
        values = keys if cache.shared_kv else cache.v[layer][slots]
        r = torch.arange(rows, device=device)[None, :]
        key_pos = positions[:, None] - (positions[:, None] - r) % rows  # [B, rows]; < 0: empty
        return _attend_chunk(q[:, None], keys, values, positions[:, None], key_pos, scaling,
                             scores, False, cache.window)[:, 0]
    out = q.new_empty((*q.shape[:2], v.shape[-1]))
    for r in forward_batch.requests():
        start, end, prefix = r.start, r.end, r.prefix
        first, keys, values = _window_keys(cache, layer, r.slot, prefix, k[start:end],
                                           v[start:end])
        query_pos = torch.arange(prefix, prefix + r.extend, device=q.device)[None]
        key_pos = torch.arange(first, first + keys.shape[1], device=q.device)
        out[start:end] = _attend(q[None, start:end], keys[None], values[None], query_pos,
                                 key_pos, scaling, scores, window=cache.window)[0]
    return out


def _window_keys(cache, layer: int, slot: int, prefix: int, k, v):
    """(first key position, keys, values) a windowed request's new queries may see: the ring's
    last ``window - 1`` cached positions, then this forward's. The ring takes the new tokens
    after the read, since they may overwrite rows the read still needs."""
    n, rows = k.shape[0], cache.rows
    first = max(0, prefix - (cache.window - 1))
    past = torch.arange(first, prefix, device=k.device) % rows
    # the slot first (a view [KVH, rows, D]), then its ring rows: [KVH, prefix - first + n, D]
    keys = torch.cat((cache.k[layer][slot][:, past], k.transpose(0, 1)), dim=1)
    values = keys if cache.shared_kv else torch.cat(
        (cache.v[layer][slot][:, past], v.transpose(0, 1)), dim=1)
    keep = min(n, rows)  # only the last ``rows`` new positions can be seen again
    ring = torch.arange(prefix + n - keep, prefix + n, device=k.device) % rows
    cache.k[layer][slot][:, ring] = k[n - keep:].transpose(0, 1)
    if not cache.shared_kv:
        cache.v[layer][slot][:, ring] = v[n - keep:].transpose(0, 1)
    return first, keys, values


def _share_attention(cache, layer: int, q, k, v, forward_batch, scaling: float, scores,
                     queries, window=None):
    """A CP share: every token's k/v is written (in token order), and the share's query rows,
    at scattered positions of their requests, attend a request at a time."""
    out = q.new_empty((*q.shape[:2], v.shape[-1]))
    queries = queries.to(q.device)
    for r in forward_batch.requests():
        slot, prefix, start, end = r.slot, r.prefix, r.start, r.end
        total = prefix + r.extend
        cache.k[layer][slot, :, prefix:total] = k[start:end].transpose(0, 1)  # [KVH, n, D]
        if not cache.shared_kv:
            cache.v[layer][slot, :, prefix:total] = v[start:end].transpose(0, 1)
        lo, hi = (int(i) for i in torch.searchsorted(
            queries, torch.tensor([start, end], device=q.device)))
        if hi > lo:
            query_pos = (prefix + queries[lo:hi] - start)[None]  # [1, rows]
            keys = cache.k[layer][slot:slot + 1, :, :total]
            values = keys if cache.shared_kv else cache.v[layer][slot:slot + 1, :, :total]
            out[lo:hi] = _attend(q[None, lo:hi], keys, values, query_pos,
                                 torch.arange(total, device=q.device), scaling, scores,
                                 window=window)[0]
    return out
