"""Rotary position embedding as the reference checkpoints define it (HF numerics)."""

from __future__ import annotations

import torch


def inverse_frequencies(theta: float, dim: int) -> torch.Tensor:
    """[dim/2] rotation frequencies of the default rope type (uninitialized on the meta
    device: a plan or a memory estimate needs the shape only, and a meta op's first use
    costs a second of imports)."""
    if torch.get_default_device().type == "meta":
        return torch.empty((dim + 1) // 2)
    return 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype):
    """cos/sin of each position's angles, [T, D/2], computed in fp32 and rounded like HF."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleave: bool) -> torch.Tensor:
    """RoPE over x [T, H, D] with cos/sin [T, D/2].

    ``interleave``: pairs (x0, x1), (x2, x3), ... rotate together and the result is laid out
    de-interleaved (evens then odds), as HF's ``apply_rotary_pos_emb_interleave``; q and k use
    the same layout, so their dot products are those of the interleaved rotation. Otherwise
    the rotate-half form.
    """
    cos, sin = cos[:, None, :], sin[:, None, :]
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
