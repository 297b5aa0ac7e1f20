"""A plain per-request KV cache: [slots, kv_heads, rows, head_dim] per layer, or a ring for a
sliding window (``attention.cached_attention`` reads and writes it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCache:
    """k/v for ``layers`` (a count, or the global indices a pipeline stage holds): [slots,
    kv_heads, rows, head_dim] each (v may have its own head dim, as MLA's does), indexed by
    the layer's global index. Head-major, as attention reads it: a request's keys of one head
    are consecutive rows, so a batch's keys are a view in the layout attention kernels take.

    ``window`` (sliding-window attention): a query sees only the last ``window`` positions,
    itself included, so the cache keeps ``min(max_len, window)`` rows per request as a ring
    (position p in row p mod rows). ``shared_kv``: one tensor read as both keys and values
    (DeepSeek-V4's K=V attention), stored once. ``values_from_keys=n``: each value is its
    key's first ``n`` dims, stored once (MLA's latent cache: keys [latent | rotated key],
    values the latent).
    """

    # class defaults: a cache that shares another's tensors without running __init__ (such
    # as Nemotron-H's HybridCache) is a full, separate-k/v one
    window: int | None = None
    shared_kv: bool = False
    # a decode step (one query row a request) reads each request's keys and values where they
    # lie, up to its own length (``decode_kernel``, Triton), instead of gathering whole slots:
    # in ``cached_attention``'s padded and ring decode paths. Off unless set (a model with the
    # Triton provider sets it on the caches it makes, ``CausalLM.install_fusion``): the
    # kernel is proven under the interpreter; its compiled form waits for a GPU run
    # (scripts/gpu_check.py, "captured decode ... in place") before it becomes CUDA's default
    decode_in_place: bool = False

    def __init__(self, layers, slots: int, max_len: int, kv_heads: int | dict,
                 head_dim: int | dict, dtype: torch.dtype, device="cpu",
                 v_head_dim: int | None = None, window: int | None = None,
                 shared_kv: bool = False, values_from_keys: int | None = None) -> None:
        """``kv_heads`` and ``head_dim``: every layer's, or {layer: its own} (Inkling's full
        and sliding layers differ)."""
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be positive, got {window}")
        rows = max_len if window is None else min(max_len, window)
        layers = range(layers) if isinstance(layers, int) else layers
        heads = kv_heads if isinstance(kv_heads, dict) else dict.fromkeys(layers, kv_heads)
        dims = head_dim if isinstance(head_dim, dict) else dict.fromkeys(layers, head_dim)
        self.k = {i: torch.zeros((slots, heads[i], rows, dims[i]), dtype=dtype, device=device)
                  for i in layers}
        if shared_kv:
            self.v = self.k
        elif values_from_keys is not None:  # views: a value written is its key's first dims
            self.v = {i: k[..., :values_from_keys] for i, k in self.k.items()}
        else:
            self.v = {i: torch.zeros((slots, heads[i], rows, v_head_dim or dims[i]),
                                     dtype=dtype, device=device) for i in layers}
        self.max_len, self.window, self.rows, self.shared_kv = max_len, window, rows, shared_kv
        if torch.device(device).type == "cuda":
            # a compiled forward's graph writes these in place: marked static, inductor keeps
            # the write inside its CUDA graph (a mutated input it cannot pin makes it skip the
            # graph), as transformers' static cache does
            for t in (*self.k.values(), *({} if shared_kv else self.v).values()):
                torch._dynamo.mark_static_address(t)

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


@dataclass(frozen=True)
class CacheLayout:
    """What a model's KV cache keeps on this pipeline stage (``CausalLM.cache_layout``):
    ``layers`` {cache index: (this rank's kv heads, head dim)} of the attention layers whose
    keys and values it keeps, and how (``KVCache``'s ``window``, ``shared_kv``,
    ``values_from_keys``)."""

    layers: dict
    window: int | None = None
    shared_kv: bool = False
    values_from_keys: int | None = None

    @classmethod
    def of(cls, attention, **how) -> CacheLayout:
        """The layout of attention modules ``attention`` (each with its cache ``index``, its
        ``qkv_proj``'s kv heads on this rank and its ``head_dim``)."""
        return cls({a.index: (a.qkv_proj.num_kv_heads, a.head_dim) for a in attention}, **how)

    def build(self, slots: int, max_len: int, dtype: torch.dtype, device) -> KVCache:
        """The cache of ``slots`` requests of up to ``max_len`` positions."""
        return KVCache(list(self.layers), slots, max_len,
                       {i: heads for i, (heads, _) in self.layers.items()},
                       {i: dim for i, (_, dim) in self.layers.items()}, dtype, device=device,
                       window=self.window, shared_kv=self.shared_kv,
                       values_from_keys=self.values_from_keys)


# the attention that reads this cache, where it was first defined (model files import it from
# ``.attention``)
from .attention import cached_attention  # noqa: E402,F401
