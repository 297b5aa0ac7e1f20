"""The gated DeltaNet linear-attention mixer of Qwen3-Next and Qwen3.5, heads over attention TP.

Numerics follow transformers' pure-torch path (``Qwen3NextGatedDeltaNet`` without the fla /
causal-conv1d kernels): a causal depthwise conv (silu) over q|k|v, q and k L2-normalised, then
the gated delta rule: a prefill (or its continuation from a cached state) runs the chunked
form in chunks of 64, a one-token step after a cached prefix the recurrent form. The output
is ``out_proj(rmsnorm(o) * silu(z))``, the norm per value head.

Tensor parallelism over ``attn_tp`` (t ranks, rank r): this rank holds key heads
[r * K/t, (r+1) * K/t) and the value heads they serve, [r * V/t, (r+1) * V/t) (value head v
reads key head v // (V/K)). The projection rows, conv channels, ``A_log``/``dt_bias`` and
``out_proj``'s input columns follow those heads; the gated norm's weight (one per value head
dim) is whole on every rank. ``out_proj`` is row-parallel and reduces unless the mixer's exit
takes the sum.

Two checkpoint layouts of the input projection:

* Qwen3-Next (``in_proj_qkvz``, ``in_proj_ba``): rows grouped per key head,
  [q_g | k_g | v_g | z_g] and [b_g | a_g], so a rank's heads are one contiguous block;
* Qwen3.5 (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``): [q | k | v] of all
  heads, then z, b and a separately.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import RowParallelLinear
from ..runtime.invariant import BATCH_INVARIANT
from ..runtime.norm import rms_fp32
from .attention import slot_index
from .mamba2 import DepthwiseConv, ShardedLinear, _param, conv_decode, conv_per_request

CHUNK = 64  # transformers' torch_chunk_gated_delta_rule default


def check_heads(num_key_heads: int, num_value_heads: int, tp: int) -> None:
    """Key heads split over attention TP (each rank then holds the value heads they serve)."""
    if num_value_heads % num_key_heads:
        raise ValueError(f"linear_num_value_heads={num_value_heads} is not divisible by "
                         f"linear_num_key_heads={num_key_heads}")
    if num_key_heads % tp:
        raise ValueError(f"linear_num_key_heads={num_key_heads} is not divisible by attention "
                         f"tp={tp}")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta(q, k, v, g, beta, initial_state=None, chunk_size: int = CHUNK):
    """The chunked gated delta rule of one request, as transformers' torch form.

    q, k: [n, h, dk] (already repeated to the value heads, L2-normalised, fp32); v: [n, h, dv];
    g (log decay), beta: [n, h]; initial_state: [h, dk, dv] or None.
    Returns (out [n, h, dv] fp32, final state [h, dk, dv] fp32).
    """
    n, heads, dk = k.shape
    dv = v.shape[-1]
    # [n, h, ...] -> [h, n, ...]
    q, k, v, beta, g = (x.transpose(0, 1).float().contiguous() for x in (q, k, v, beta, g))
    q = q * dk ** -0.5
    pad = (chunk_size - n % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    # [h, n + pad, d] -> [h, chunks, chunk_size, d]
    q, k, k_beta, v_beta = (x.reshape(heads, -1, chunk_size, x.shape[-1])
                            for x in (q, k, k_beta, v_beta))
    g = g.reshape(heads, -1, chunk_size).cumsum(dim=-1)  # decay from each chunk's start
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # the UT transform folds a chunk's delta updates into matmuls
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    attn = (q @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * g.exp()[..., None], upper=False,
                                               unitriangular=True)
    state = (torch.zeros((heads, dk, dv), dtype=torch.float32, device=q.device)
             if initial_state is None else initial_state.float())
    out = torch.zeros_like(values)
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]  # [h, chunks, 1, 1]
    for i in range(values.shape[1]):
        v_new = values[:, i] - k_cumdecay[:, i] @ state  # what the state does not predict
        out[:, i] = q[:, i] @ state + attn[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, -1, dv)[:, :n]  # [h, n, dv]
    return out.transpose(0, 1), state


def recurrent_gated_delta(q, k, v, g, beta, state):
    """One token's step of ``state`` [..., h, dk, dv] (fp32, updated in place), as
    transformers' torch recurrent form; the leading dims are requests (a decode batch) or
    none. q, k: [..., h, dk] (repeated, L2-normalised); v: [..., h, dv]; g, beta: [..., h].
    Returns [..., h, dv]."""
    q, k, v = q.float() / q.shape[-1] ** 0.5, k.float(), v.float()  # as transformers
    new = state * g.float().exp()[..., None, None]
    memory = (new * k[..., None]).sum(dim=-2)  # [..., h, dv]: the state's prediction of v
    delta = (v - memory) * beta.float()[..., None]
    new = new + k[..., None] * delta[..., None, :]
    state.copy_(new)
    return (new * q[..., None]).sum(dim=-2)


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x)`` (rounded to x's dtype first) times ``silu(z)``, per value head
    (transformers' ``Qwen3NextRMSNormGated``); the weight is whole on every rank."""

    def __init__(self, head_dim: int, eps: float, dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = self.weight * rms_fp32(x.float(), self.eps).to(dtype)
        return (h * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """The gated DeltaNet mixer on this attention-DP rank's rows; ``index`` is its place among
    the linear-attention layers (its slot in the recurrent state, a ``MambaState`` holding the
    conv window and the [v heads, dk, dv] state per request).

    Args:
        cfg: a Qwen3-Next / Qwen3.5 config (``linear_*`` fields, ``rms_norm_eps``,
            ``split_projections``: the Qwen3.5 layout).
        index: its linear-attention layer index.
        runtime, dtype: where it runs.
    """

    def __init__(self, cfg, index: int, runtime, dtype):
        super().__init__()
        group = runtime.parallel.attn_tp_group
        tp, rank = group.size, group.rank
        K, V = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        check_heads(K, V, tp)
        self.index, self.kernel = index, cfg.linear_conv_kernel_dim
        self.k_heads, self.v_heads = K // tp, V // tp  # local
        self.dk, self.dv, self.ratio = dk, dv, V // K
        self.key_dim, self.value_dim = self.k_heads * dk, self.v_heads * dv  # local channels
        self.conv_channels = 2 * self.key_dim + self.value_dim
        self.split = cfg.split_projections
        q_rows = (rank * self.key_dim, self.key_dim)
        v_rows = (rank * self.value_dim, self.value_dim)
        heads_rows = (rank * self.v_heads, self.v_heads)
        # conv channels: [q | k | v] of the full [K dk | K dk | V dv]
        conv = [q_rows, (K * dk + q_rows[0], self.key_dim),
                (2 * K * dk + v_rows[0], self.value_dim)]
        conv_dim = 2 * K * dk + V * dv
        if self.split:
            self.in_proj_qkv = ShardedLinear(cfg.hidden_size, conv, False, dtype, full=conv_dim)
            self.in_proj_z = ShardedLinear(cfg.hidden_size, [v_rows], False, dtype, full=V * dv)
            self.in_proj_b = ShardedLinear(cfg.hidden_size, [heads_rows], False, dtype, full=V)
            self.in_proj_a = ShardedLinear(cfg.hidden_size, [heads_rows], False, dtype, full=V)
        else:  # per key head [q | k | v | z] and [b | a]: this rank's heads are one block
            per_head = 2 * dk + 2 * self.ratio * dv
            self.in_proj_qkvz = ShardedLinear(
                cfg.hidden_size, [(rank * self.k_heads * per_head, self.k_heads * per_head)],
                False, dtype, full=K * per_head)
            self.in_proj_ba = ShardedLinear(
                cfg.hidden_size, [(rank * 2 * self.v_heads, 2 * self.v_heads)], False, dtype,
                full=2 * V)
        self.conv1d = DepthwiseConv(conv, self.kernel, False, dtype, full=conv_dim)
        self.dt_bias = _param((self.v_heads,), dtype, [heads_rows], V)
        self.A_log = _param((self.v_heads,), dtype, [heads_rows], V)
        self.norm = GatedRMSNorm(dv, cfg.rms_norm_eps, dtype)
        self.out_proj = RowParallelLinear(V * dv, cfg.hidden_size, group, bias=False,
                                          dtype=dtype, name="out_proj")

    def project(self, x: torch.Tensor):
        """x [T, hidden] -> (q|k|v conv inputs [T, C], z [T, Hv, dv], b [T, Hv], a [T, Hv])."""
        tokens = x.shape[0]
        if self.split:
            z = self.in_proj_z(x).view(tokens, self.v_heads, self.dv)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r = self.ratio
        qkvz = self.in_proj_qkvz(x).view(tokens, self.k_heads, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        ba = self.in_proj_ba(x).view(tokens, self.k_heads, 2 * r)
        b, a = ba.split([r, r], dim=-1)
        # [T, Hk, ...] -> [T, channels] in the conv's [q | k | v] order (T may be 0: no -1)
        qkv = torch.cat([q.reshape(tokens, self.key_dim), k.reshape(tokens, self.key_dim),
                         v.reshape(tokens, self.value_dim)], dim=-1)
        return (qkv, z.reshape(tokens, self.v_heads, self.dv), b.reshape(tokens, self.v_heads),
                a.reshape(tokens, self.v_heads))

    def forward(self, hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
        """[T, hidden] (this DP rank's rows, requests concatenated) -> [T, hidden], summed over
        attn_tp unless the exit leaves the sum to the boundary."""
        tokens = hidden_states.shape[0]
        qkv, z, b, a = self.project(hidden_states)
        state = forward_batch.kv_cache
        conv_state, recurrent = state.conv[self.index], state.ssm[self.index]
        beta = torch.sigmoid(b)
        # [T, Hv], <= 0
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        # batch-invariant: each request its own conv and state update (as Mamba2's)
        if forward_batch.decode_step and not BATCH_INVARIANT.on:
            out = self._decode(qkv, g, beta, conv_state, recurrent, forward_batch)
        else:
            out = self._per_request(qkv, g, beta, conv_state, recurrent, forward_batch)
        # transformers rounds the core output to the model dtype before the gated norm
        y = self.norm(out.to(hidden_states.dtype), z)  # [T, Hv, dv]
        return self.out_proj(y.reshape(tokens, self.value_dim))

    def _heads(self, conv: torch.Tensor):
        """A conv output [n, C] -> q, k [n, Hv, dk] (L2-normalised; each key head serves
        `ratio` consecutive value heads) and v [n, Hv, dv]."""
        n = conv.shape[0]
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(n, self.k_heads, self.dk).float()).repeat_interleave(self.ratio, 1)
        k = l2norm(k.reshape(n, self.k_heads, self.dk).float()).repeat_interleave(self.ratio, 1)
        return q, k, v.reshape(n, self.v_heads, self.dv)

    def _per_request(self, qkv, g, beta, conv_state, recurrent, forward_batch):
        """Each request in turn (a prefill's chunked form, or a decode step's recurrent
        one): [T, Hv, dv] fp32."""
        out = qkv.new_empty((qkv.shape[0], self.v_heads, self.dv), dtype=torch.float32)
        for slot, prefix, start, end, conv in conv_per_request(self.conv1d, conv_state, qkv,
                                                               forward_batch):
            q, k, v = self._heads(conv)
            if prefix and end - start == 1:  # a decode step: the recurrent form
                out[start] = recurrent_gated_delta(q[0], k[0], v[0], g[start], beta[start],
                                                   recurrent[slot])
            else:  # a prefill (or its continuation): the chunked form from the cached state
                out[start:end], recurrent[slot] = chunk_gated_delta(
                    q, k, v, g[start:end], beta[start:end],
                    initial_state=recurrent[slot] if prefix else None)
        return out

    def _decode(self, qkv, g, beta, conv_state, recurrent, forward_batch):
        """A decode step over every request at once (one row each): [R, Hv, dv] fp32."""
        rows = slot_index(forward_batch.req_slots, qkv.device)
        q, k, v = self._heads(conv_decode(self.conv1d, conv_state, qkv, rows))
        state = recurrent[rows]  # [R, Hv, dk, dv]: a view, or a gathered copy written back
        out = recurrent_gated_delta(q, k, v, g, beta, state)
        if not isinstance(rows, slice):
            recurrent[rows] = state
        return out
