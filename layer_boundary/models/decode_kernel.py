"""Decode attention that reads the KV cache where it lies: one query row a request, each
request's keys and values read from its own slot up to its own length, never gathered into a
copy (``attention._slot_attention`` gathers every row of every slot, ``max_len`` of them).

Split-K (flash-decoding): a program per (row, kv head, split) walks its share of the row's
keys in blocks with an online softmax in fp32, for the query heads that share the kv head
(GQA: K/V read once per kv head); a second kernel merges the splits' partial maxima, sums and
outputs (a sink logit per head, where the model has them, joining the merge) and rounds once
to the output dtype. A sliding window reads
the row's last ``window`` positions; a ring cache (``KVCache.window``) keeps position p in row
p mod rows. A softcap is applied to each scaled score before the mask.

On a CUDA device the kernel compiles; on the CPU it runs under the Triton interpreter
(``TRITON_INTERPRET=1``, chosen before triton is first imported), where the tests hold it to
the torch path. This module imports ``triton`` at import: ``attention`` imports it only for a
cache that decodes in place (``KVCache.decode_in_place``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime.kernel_ops import compiled_as_op

SPLITS = 4  # key blocks walked in parallel per (row, kv head): enough to fill a GPU at B=1
BLOCK_N = 32  # keys a step


@triton.jit
def _decode_split(q_ptr, k_ptr, v_ptr, slots_ptr, lengths_ptr, m_ptr, l_ptr, acc_ptr,
                  q_row, q_head, k_slot, k_head, k_row, v_slot, v_head, v_row,
                  part_row, part_head, acc_row, acc_head, acc_split,
                  scaling, softcap, window, rows, GROUP: tl.constexpr,
                  BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                  SPLITS: tl.constexpr, RING: tl.constexpr, SOFTCAP: tl.constexpr):
    t = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    slot = tl.load(slots_ptr + t)
    length = tl.load(lengths_ptr + t)  # keys at positions [first, length)
    first = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    per_split = (length - first + SPLITS - 1) // SPLITS
    lo = first + s * per_split
    hi = tl.minimum(lo + per_split, length)
    heads = g * GROUP + tl.arange(0, BLOCK_G)  # the query heads of kv head g
    dims = tl.arange(0, BLOCK_D)
    vdims = tl.arange(0, BLOCK_DV)
    head_ok = tl.arange(0, BLOCK_G) < GROUP
    q = tl.load(q_ptr + t * q_row + heads[:, None] * q_head + dims[None, :],
                mask=head_ok[:, None] & (dims[None, :] < D), other=0.0).to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        row = pos % rows if RING else pos
        k = tl.load(k_ptr + slot * k_slot + g * k_head + row[:, None] * k_row + dims[None, :],
                    mask=ok[:, None] & (dims[None, :] < D), other=0.0).to(tl.float32)
        score = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scaling  # [G, N]
        if SOFTCAP:
            e = tl.exp(2.0 * score / softcap)
            score = softcap * (1.0 - 2.0 / (e + 1.0))  # softcap * tanh(score / softcap)
        score = tl.where(ok[None, :], score, float("-inf"))
        m_new = tl.maximum(m, tl.max(score, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(score - m_new[:, None])
        v = tl.load(v_ptr + slot * v_slot + g * v_head + row[:, None] * v_row + vdims[None, :],
                    mask=ok[:, None] & (vdims[None, :] < DV), other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        den = den * alpha + tl.sum(p, axis=1)
        m = m_new
    where = t * part_row + heads * part_head + s
    tl.store(m_ptr + where, m, mask=head_ok)
    tl.store(l_ptr + where, den, mask=head_ok)
    tl.store(acc_ptr + t * acc_row + heads[:, None] * acc_head + s * acc_split + vdims[None, :],
             acc, mask=head_ok[:, None] & (vdims[None, :] < DV))


@triton.jit
def _merge_splits(m_ptr, l_ptr, acc_ptr, sinks_ptr, out_ptr, part_row, part_head, acc_row,
                  acc_head, acc_split, out_row, out_head, DV: tl.constexpr,
                  BLOCK_DV: tl.constexpr, SPLITS: tl.constexpr, SINKS: tl.constexpr):
    """A program per (row, head): the splits' partials merged by their maxima (an empty
    split's is -inf and weighs nothing), a sink logit joining the denominator."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, SPLITS)
    vdims = tl.arange(0, BLOCK_DV)
    m = tl.load(m_ptr + t * part_row + h * part_head + splits)
    den = tl.load(l_ptr + t * part_row + h * part_head + splits)
    top = tl.max(m, axis=0)
    if SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        top = tl.maximum(top, sink)
    weight = tl.exp(m - top)
    total = tl.sum(den * weight, axis=0)
    if SINKS:
        total += tl.exp(sink - top)
    acc = tl.load(acc_ptr + t * acc_row + h * acc_head + splits[:, None] * acc_split
                  + vdims[None, :], mask=vdims[None, :] < DV, other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / total
    tl.store(out_ptr + t * out_row + h * out_head + vdims,
             out.to(out_ptr.dtype.element_ty), mask=vdims < DV)


@triton.jit
def _store_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, rows_ptr, k_tok, k_head,
              v_tok, v_head, kc_slot, kc_head, kc_row, vc_slot, vc_head, vc_row,
              D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr,
              BLOCK_DV: tl.constexpr, VALUES: tl.constexpr):
    """A program per (row, kv head): the row's new key, then its value, copied to (its slot,
    its cache row), bits unchanged (the key first: a value that is its key's first dims is
    written over them, as two index writes in that order leave it)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    row = tl.load(rows_ptr + t)
    dims = tl.arange(0, BLOCK_D)
    key = tl.load(k_ptr + t * k_tok + h * k_head + dims, mask=dims < D)
    tl.store(k_cache_ptr + slot * kc_slot + h * kc_head + row * kc_row + dims, key,
             mask=dims < D)
    if VALUES:
        vdims = tl.arange(0, BLOCK_DV)
        value = tl.load(v_ptr + t * v_tok + h * v_head + vdims, mask=vdims < DV)
        tl.store(v_cache_ptr + slot * vc_slot + h * vc_head + row * vc_row + vdims, value,
                 mask=vdims < DV)


def launch(kernel, grid, *args, **meta) -> None:
    """One launch of ``kernel`` (what a count of a step's launches counts as one: on the CPU
    the interpreter copies its arguments in and out, which a GPU never does)."""
    kernel[grid](*args, **meta)


def _attention_shape(q, k_cache, v_cache, slots, lengths, scaling, window=None, ring=False,
                     sinks=None, softcap=None):
    return q.new_empty((*q.shape[:2], v_cache.shape[-1]))


@compiled_as_op("decode_attention", _attention_shape)
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, lengths: torch.Tensor, scaling: float,
                     window: int | None = None, ring: bool = False,
                     sinks: torch.Tensor | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """Each row of ``q`` attends over its own slot's cached keys, in place.

    Args:
        q: [T, H, D], one query row per request (a padded row attends like any other).
        k_cache, v_cache: one layer's cache, [slots, KVH, rows, D] and [slots, KVH, rows, Dv]
            (H a multiple of KVH); the row's own k/v already written.
        slots: [T] each row's cache slot; lengths: [T] how many positions it sees (its
            position + 1).
        scaling: the softmax scale.
        window: a sliding window (the last ``window`` positions, its own included); None:
            every position.
        ring: the cache keeps position p in row p mod rows (a sliding-window ring).
        sinks: [H] a logit per head joining the softmax (fp32), or None.
        softcap: each scaled score s becomes softcap * tanh(s / softcap); None: none.

    Returns:
        [T, H, Dv] in ``q``'s dtype.
    """
    tokens, heads, dim = q.shape
    kv_heads, rows, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[-1]
    group = heads // kv_heads
    # the splits' partial maxima, sums and outputs: views of one fp32 workspace (one
    # allocation), each laid out as the kernels index it
    n = tokens * heads * SPLITS
    work = q.new_empty(n * (2 + dv), dtype=torch.float32)
    m, den = work[:n].view(tokens, heads, SPLITS), work[n:2 * n].view(tokens, heads, SPLITS)
    acc = work[2 * n:].view(tokens, heads, SPLITS, dv)
    if tokens:
        launch(_decode_split, (tokens, kv_heads, SPLITS),
            q, k_cache, v_cache, slots, lengths, m, den, acc,
            q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
            scaling, softcap or 1.0, window or 0, rows, GROUP=group,
            BLOCK_G=triton.next_power_of_2(group), D=dim, BLOCK_D=triton.next_power_of_2(dim),
            DV=dv, BLOCK_DV=triton.next_power_of_2(dv), BLOCK_N=BLOCK_N, SPLITS=SPLITS,
            RING=ring, SOFTCAP=softcap is not None)
    out = _attention_shape(q, k_cache, v_cache, slots, lengths, scaling)
    if tokens:
        launch(_merge_splits, (tokens, heads), m, den, acc, m if sinks is None else sinks, out,
               m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
               out.stride(0), out.stride(1), DV=dv, BLOCK_DV=triton.next_power_of_2(dv),
               SPLITS=SPLITS, SINKS=sinks is not None)
    return out


def _stored(k_cache, v_cache, slots, rows, k, v) -> None:
    return None


@compiled_as_op("store_kv", _stored, mutates_args=("k_cache", "v_cache"))
def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor | None, slots: torch.Tensor,
             rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Each row's new key and value written to its slot's cache row, one launch (the two
    index writes it replaces are two).

    Args:
        k_cache, v_cache: one layer's cache, [slots, KVH, rows, D] / [..., Dv] (v_cache None:
            the keys are the values; a view of the keys' first dims: written after them).
        slots, rows: [T] each row's slot and cache row (its position, or position mod the
            ring's rows).
        k, v: [T, KVH, D] / [T, KVH, Dv], each head's dims contiguous.
    """
    tokens, kv_heads, dim = k.shape
    if not tokens:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    values = v_cache if v_cache is not None else k_cache
    if v.stride(-1) != 1:
        v = v.contiguous()
    dv = values.shape[-1]
    launch(_store_kv, (tokens, kv_heads), k, v, k_cache, values, slots, rows,
           k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3],
           *values.stride()[:3], D=dim, BLOCK_D=triton.next_power_of_2(dim), DV=dv,
           BLOCK_DV=triton.next_power_of_2(dv), VALUES=v_cache is not None)
