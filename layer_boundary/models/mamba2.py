"""The Mamba2 mixer of Nemotron-H in plain PyTorch, heads split over attention TP.

Numerics follow transformers' pure-torch path (``NemotronHMamba2Mixer`` without the
mamba-ssm kernels): a prefill runs the chunked SSD scan (``chunk_size`` chunks, time steps
clamped below at ``time_step_min``), a one-token step after a cached prefix runs the
recurrent update (no clamp, as transformers' ``selective_state_update`` fallback).

Tensor parallelism over ``attn_tp`` (t ranks, rank r): this rank holds heads
[r * H/t, (r+1) * H/t); the x / z / dt rows of ``in_proj``, the x conv channels, ``A_log``,
``D``, ``dt_bias``, the gated norm's weight and ``out_proj``'s input columns follow those heads.
The B/C groups: with ``n_groups % t == 0`` each rank holds its own ``n_groups / t`` groups;
with ``t % n_groups == 0`` each rank holds (a replica of) the one group its heads read. The
gated RMSNorm normalises per group; a group spread over several ranks sums its squares over
``attn_tp``. ``out_proj`` is row-parallel and reduces unless the mixer's exit takes the sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import RowParallelLinear, all_reduce_rows
from ..runtime.invariant import BATCH_INVARIANT
from ..runtime.linear import expect_shape
from ..runtime.ledger import statistics_site
from ..runtime.norm import rms_fp32
from .attention import slot_index


def group_split(n_groups: int, num_heads: int, tp: int) -> tuple[int, int]:
    """(local groups, ranks per group) of the B/C groups over ``tp`` attention-TP ranks."""
    if num_heads % tp:
        raise ValueError(f"mamba_num_heads={num_heads} is not divisible by attention tp={tp}")
    if n_groups % tp == 0:
        return n_groups // tp, 1
    if tp % n_groups == 0:
        return 1, tp // n_groups
    raise ValueError(f"n_groups={n_groups} (mamba_num_heads={num_heads}) cannot be split over "
                     f"attention tp={tp}: one of n_groups and tp must divide the other")


def _slices_loader(ranges: list[tuple[int, int]], full: int):
    """A weight_loader that keeps the (start, size) row ranges of the full tensor (``full``
    rows), in order."""

    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        expect_shape(loaded, full, *param.shape[1:])
        param.data.copy_(torch.cat([loaded.narrow(0, start, size) for start, size in ranges]))

    return load


def _param(shape, dtype, ranges, full: int) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = _slices_loader(ranges, full)
    return p


class ShardedLinear(nn.Module):
    """y = x @ W[rows].T (+ b[rows]) for the given (start, size) row ranges of the full W."""

    def __init__(self, in_features: int, ranges: list[tuple[int, int]], bias: bool, dtype,
                 full: int):
        super().__init__()
        out = sum(size for _, size in ranges)
        self.weight = _param((out, in_features), dtype, ranges, full)
        self.bias = _param((out,), dtype, ranges, full) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class DepthwiseConv(nn.Module):
    """The causal depthwise conv over this rank's conv channels (``conv1d.weight/bias`` names)."""

    def __init__(self, ranges: list[tuple[int, int]], kernel: int, bias: bool, dtype,
                 full: int):
        super().__init__()
        channels = sum(size for _, size in ranges)
        self.kernel = kernel
        self.weight = _param((channels, 1, kernel), dtype, ranges, full)
        self.bias = _param((channels,), dtype, ranges, full) if bias else None

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        """window: [kernel - 1 + n, C] (the cached inputs, then n new) -> [n, C] after silu."""
        channels = window.shape[1]
        out = F.conv1d(window.t()[None], self.weight, self.bias, groups=channels)  # [1, C, n]
        return F.silu(out[0].t())


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm_per_group(y * silu(z))`` over this rank's channels; a group whose
    channels span ``ranks_per_group`` ranks sums its squares over ``group`` (every rank of it
    runs the same all-reduce, so none may skip it)."""

    def __init__(self, channels: int, group_size: int, eps: float, group, ranks_per_group: int,
                 n_groups: int, ranges, dtype, full: int):
        super().__init__()
        self.weight = _param((channels,), dtype, ranges, full)
        self.group, self.eps, self.group_size = group, eps, group_size
        self.ranks_per_group, self.n_groups = ranks_per_group, n_groups
        self.first_group = group.rank // ranks_per_group  # the group of a split one

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y.float() * F.silu(gate.float())  # [T, C]
        if self.ranks_per_group == 1:  # whole groups here: as transformers
            # [T, C] -> [T, local groups, group_size] (no -1: T may be 0)
            grouped = h.view(h.shape[0], h.shape[1] // self.group_size, self.group_size)
            grouped = rms_fp32(grouped, self.eps)
            h = grouped.view(h.shape)
        else:  # one group over several ranks: its squares summed over attn_tp
            sums = h.new_zeros((h.shape[0], self.n_groups))  # [T, n_groups], ours only
            sums[:, self.first_group] = h.pow(2).sum(-1)
            sums = all_reduce_rows(sums, self.group, site=statistics_site())  # not an output's
            variance = sums[:, self.first_group:self.first_group + 1] / self.group_size
            h = h * torch.rsqrt(variance + self.eps)  # [T, 1]
        return self.weight * h.to(dtype)


def chunk_scan(x, dt, A, B, C, D, chunk_size: int, initial_state=None):
    """The SSD chunked scan of one request, as transformers' torch ``mamba2_chunk_scan``.

    x: [n, h, p]; dt: [n, h] (softplus'd and clamped); A, D: [h]; B, C: [n, g, s];
    initial_state: [h, p, s] or None. Returns (y [n, h, p] fp32, final state [h, p, s] fp32).
    """
    n, heads, _ = x.shape
    x = x.float()[None]  # [1, n, h, p]: b = 1 below
    B = B.float().repeat_interleave(heads // B.shape[1], dim=1)[None]  # [1, n, h, s]
    C = C.float().repeat_interleave(heads // C.shape[1], dim=1)[None]
    dt = dt[None]  # [1, n, h]
    pad = (chunk_size - n % chunk_size) % chunk_size
    d_residual = D[:, None] * F.pad(x, (0, 0, 0, 0, 0, pad))
    x = x * dt[..., None].float()
    A = A.to(x.dtype) * dt.float()  # [1, n, h]

    def chunks(t):  # [1, n, ...] -> [1, c, l, ...] (zero-padded to whole chunks)
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(1, -1, chunk_size, *t.shape[2:])

    x, A, B, C = chunks(x), chunks(A), chunks(B), chunks(C)
    A = A.permute(0, 3, 1, 2)  # [1, h, c, l]
    A_cumsum = torch.cumsum(A, dim=-1)
    # 1. within each chunk (the diagonal blocks)
    L = torch.exp(segment_sum(A))  # [1, h, c, l, l]
    G = torch.einsum("bclhn,bcshn->bclsh", C, B)
    M = G * L.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", M, x)
    # 2. each chunk's own final state
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, x)
    # 3. the recurrence over chunks, from the cached state
    previous = (initial_state[None, None].to(states.dtype) if initial_state is not None
                else torch.zeros_like(states[:, :1]))
    states = torch.cat([previous, states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]
    # 4. each chunk's start state to its outputs
    C_times_states = torch.einsum("bclhn,bchpn->bclhp", C, states)
    y_off = C_times_states * torch.exp(A_cumsum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).reshape(1, -1, heads, x.shape[-1]) + d_residual
    return y[0, :n], final_state[0]


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., l] -> [..., l, l]: out[i, j] = sum(x[j+1..i]) for j <= i, -inf above (stable)."""
    size = x.size(-1)
    x = x[..., None].expand(*x.size(), size)
    x = x.masked_fill(~torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device), -1), 0)
    x = torch.cumsum(x, dim=-2)
    return x.masked_fill(~torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device)),
                         -torch.inf)


def recurrent_step(state, x, dt, A, B, C, D):
    """One token's update of ``state`` [..., h, p, s] (fp32, in place), as transformers' torch
    ``selective_state_update``; the leading dims are requests (a decode batch) or none.
    x: [..., h, p]; dt: [..., h] (softplus'd); B, C: [..., g, s]. Returns [..., h, p]."""
    heads = x.shape[-2]
    dt = dt[..., None, None]  # [..., h, 1, 1]
    dA = torch.exp(dt.float() * A.float()[:, None, None])  # [..., h, 1, 1]
    B = B.repeat_interleave(heads // B.shape[-2], dim=-2)[..., None, :]  # [..., h, 1, s]
    C = C.repeat_interleave(heads // C.shape[-2], dim=-2)  # [..., h, s]
    new = state * dA + (dt * B) * x[..., None]  # [..., h, p, s]
    state.copy_(new.to(state.dtype))
    y = torch.matmul(new.to(C.dtype), C[..., None])[..., 0]  # [..., h, p]
    return y + x * D[:, None]


class MambaState:
    """Per request slot and Mamba layer: the conv window (the last ``conv_kernel - 1`` conv
    inputs, model dtype) and the SSM state [heads_local, head_dim, ssm_state_size] (fp32)."""

    def __init__(self, layers, slots: int, conv_channels: int, kernel: int, heads: int,
                 head_dim: int, state_size: int, dtype, device="cpu") -> None:
        layers = range(layers) if isinstance(layers, int) else layers  # Mamba layer indices
        self.conv = {i: torch.zeros((slots, kernel - 1, conv_channels), dtype=dtype,
                                    device=device) for i in layers}
        self.ssm = {i: torch.zeros((slots, heads, head_dim, state_size), dtype=torch.float32,
                                   device=device) for i in layers}


def conv_per_request(conv1d, conv_state, x, forward_batch):
    """Each request's causal depthwise conv over its rows of ``x`` [T, C], continuing from
    its cached window in ``conv_state`` [slots, kernel - 1, C] (zeros for a fresh prompt)
    and leaving its last ``kernel - 1`` inputs there. Yields (slot, prefix length, start,
    end, conv output [end - start, C]) per request, in row order."""
    keep, covered = conv1d.kernel - 1, 0
    for r in forward_batch.requests():
        past = conv_state[r.slot] if r.prefix else conv_state.new_zeros(conv_state.shape[1:])
        window = torch.cat([past, x[r.start:r.end]])  # [kernel - 1 + n, C]
        conv_state[r.slot] = window[window.shape[0] - keep:]
        yield r.slot, r.prefix, r.start, r.end, conv1d(window)
        covered = r.end
    if covered != x.shape[0]:
        raise ValueError(f"the batch's extend_lens cover {covered} rows; the mixer got "
                         f"{x.shape[0]}")


def conv_decode(conv1d, conv_state, x, rows):
    """A decode step's causal depthwise conv in one call: each request's cached window
    (``conv_state[rows]`` [R, kernel - 1, C]) and its new row of ``x`` [R, C]; the window
    moves on by one. Returns [R, C] after silu, as ``conv_per_request`` would per request."""
    window = torch.cat([conv_state[rows], x[:, None]], dim=1)  # [R, kernel, C]
    conv_state[rows] = window[:, 1:]
    out = F.conv1d(window.transpose(1, 2), conv1d.weight, conv1d.bias,
                   groups=window.shape[2])  # [R, C, 1]
    return F.silu(out[..., 0])


class Mamba2Mixer(nn.Module):
    """Nemotron-H's Mamba2 mixer on this attention-DP rank's local rows; ``index`` is its place
    among the Mamba layers (its slot in ``MambaState``)."""

    def __init__(self, cfg, index: int, runtime, dtype):
        super().__init__()
        group = runtime.parallel.attn_tp_group
        tp, rank = group.size, group.rank
        heads, p, g, s = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
        local_groups, ranks_per_group = group_split(g, heads, tp)
        inner = heads * p
        self.index, self.chunk_size, self.dt_min = index, cfg.chunk_size, cfg.time_step_min
        self.kernel = cfg.conv_kernel
        self.heads, self.head_dim = heads // tp, p  # local heads
        self.groups, self.state_size = local_groups, s
        self.inner = self.heads * p  # local x / z channels
        self.conv_channels = self.inner + 2 * local_groups * s
        g0 = rank * local_groups if ranks_per_group == 1 else rank // ranks_per_group
        x_rows = (rank * self.inner, self.inner)  # this rank's heads' channels (x, z, norm)
        heads_rows = [(rank * self.heads, self.heads)]
        # conv channels: [x | B | C] of the full [inner | g*s | g*s]
        bc = local_groups * s
        conv = [x_rows, (inner + g0 * s, bc), (inner + (g + g0) * s, bc)]
        # in_proj rows: [z | x B C | dt] of the full [inner | conv_dim | heads]
        conv_dim = inner + 2 * g * s
        proj = ([x_rows] + [(inner + start, n) for start, n in conv]
                + [(inner + conv_dim + rank * self.heads, self.heads)])
        self.in_proj = ShardedLinear(cfg.hidden_size, proj, cfg.use_bias, dtype,
                                     full=inner + conv_dim + heads)
        self.conv1d = DepthwiseConv(conv, cfg.conv_kernel, cfg.use_conv_bias, dtype,
                                    full=conv_dim)
        self.dt_bias = _param((self.heads,), dtype, heads_rows, heads)
        self.A_log = _param((self.heads,), dtype, heads_rows, heads)
        self.D = _param((self.heads,), dtype, heads_rows, heads)
        self.norm = GatedRMSNorm(self.inner, inner // g, cfg.layer_norm_epsilon, group,
                                 ranks_per_group, g, [x_rows], dtype, full=inner)
        self.out_proj = RowParallelLinear(inner, cfg.hidden_size, group, bias=cfg.use_bias,
                                          dtype=dtype, name="out_proj")

    def forward(self, hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
        """[T, hidden] (this DP rank's rows, requests concatenated) -> [T, hidden], summed over
        attn_tp unless the exit leaves the sum to the boundary."""
        tokens = hidden_states.shape[0]
        z, xbc, dt = self.in_proj(hidden_states).split(
            [self.inner, self.conv_channels, self.heads], dim=-1)
        state: MambaState = forward_batch.kv_cache
        conv_state, ssm_state = state.conv[self.index], state.ssm[self.index]
        A = -torch.exp(self.A_log.float())
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype))  # [T, h_local]
        # batch-invariant: each request its own conv and state update, an algorithm of its own
        # (the batched decode step convolves and updates every request's state in one call)
        if forward_batch.decode_step and not BATCH_INVARIANT.on:
            y = self._decode(xbc, dt, A, conv_state, ssm_state, forward_batch)
        else:
            y = self._per_request(xbc, dt, A, conv_state, ssm_state, forward_batch)
        y = self.norm(y.view(tokens, self.inner), z)
        return self.out_proj(y.to(hidden_states.dtype))

    def _per_request(self, xbc, dt, A, conv_state, ssm_state, forward_batch):
        """Each request in turn (a prefill's chunked scan, or a decode step's recurrent
        form): [T, h_local, p] fp32."""
        y = xbc.new_empty((xbc.shape[0], self.heads, self.head_dim), dtype=torch.float32)
        for slot, prefix, start, end, conv in conv_per_request(self.conv1d, conv_state, xbc,
                                                               forward_batch):
            n = end - start
            x, B, C = conv.split(
                [self.inner, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
            x = x.reshape(n, self.heads, self.head_dim)
            B = B.reshape(n, self.groups, self.state_size)
            C = C.reshape(n, self.groups, self.state_size)
            if prefix and n == 1:  # a decode step: the recurrent form
                y[start] = recurrent_step(ssm_state[slot], x[0], dt[start], A, B[0], C[0],
                                          self.D)
            else:  # a prefill (or its continuation): the chunked scan from the cached state
                y[start:end], ssm_state[slot] = chunk_scan(
                    x, dt[start:end].clamp(min=self.dt_min), A, B, C, self.D, self.chunk_size,
                    initial_state=ssm_state[slot] if prefix else None)
        return y

    def _decode(self, xbc, dt, A, conv_state, ssm_state, forward_batch):
        """A decode step over every request at once (one row each): [R, h_local, p] fp32."""
        rows = slot_index(forward_batch.req_slots, xbc.device)
        r = xbc.shape[0]
        x, B, C = conv_decode(self.conv1d, conv_state, xbc, rows).split(
            [self.inner, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
        state = ssm_state[rows]  # [R, h, p, s]: a view, or a gathered copy written back
        y = recurrent_step(state, x.reshape(r, self.heads, self.head_dim), dt, A,
                           B.reshape(r, self.groups, self.state_size),
                           C.reshape(r, self.groups, self.state_size), self.D)
        if not isinstance(rows, slice):
            ssm_state[rows] = state
        return y
