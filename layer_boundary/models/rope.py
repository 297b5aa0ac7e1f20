"""Rotary position embedding as the reference checkpoints define it (HF numerics)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch



def inverse_frequencies(theta: float, dim: int) -> torch.Tensor:
    """[dim/2] rotation frequencies of the default rope type (uninitialized on the meta
    device: a plan or a memory estimate needs the shape only, and a meta op's first use
    costs a second of imports)."""
    if torch.get_default_device().type == "meta":
        return torch.empty((dim + 1) // 2)
    return 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))


def yarn_frequencies(theta: float, dim: int, *, factor: float,
                     original_max_position_embeddings: int, beta_fast: float = 32.0,
                     beta_slow: float = 1.0, truncate: bool = True,
                     attention_factor: float | None = None, mscale: float | None = None,
                     mscale_all_dim: float | None = None) -> tuple[torch.Tensor, float]:
    """YaRN's [dim/2] inverse frequencies and its attention factor (the scale of cos and sin),
    in the arithmetic and order of transformers' ``_compute_yarn_parameters``: dims rotating
    fewer than ``beta_slow`` times over the original context are interpolated (divided by
    ``factor``), those rotating more than ``beta_fast`` times kept, a linear ramp between;
    the factor is ``0.1 * ln(factor) + 1`` (or the ratio of the ``mscale`` pair) unless given."""

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        attention_factor = (float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
                            if mscale and mscale_all_dim else get_mscale(factor))

    def correction_dim(rotations):
        return (dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    if torch.get_default_device().type == "meta":
        return torch.empty((dim + 1) // 2), attention_factor
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # the share of each dim's extrapolated (unscaled) frequency
    return interpolation * (1 - kept) + extrapolation * kept, attention_factor


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype, scale: float = 1.0):
    """cos/sin of each position's angles, [T, D/2], computed in fp32 and rounded like HF
    (``scale``: both multiplied by it in fp32 before the rounding, YaRN's attention factor)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    if scale != 1.0:
        return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def rope_key(inv_freq: torch.Tensor) -> tuple:
    """What identifies a rotary table across layers: its frequencies' values (layers whose
    frequencies are equal share one table per forward; a meta tensor has no values, and a
    model on the meta device never runs a forward)."""
    if inv_freq.device.type == "meta":
        return ("meta", inv_freq.shape[0])
    return tuple(inv_freq.tolist())


def forward_cos_sin(forward_batch, key: tuple, positions: torch.Tensor, inv_freq: torch.Tensor,
                    dtype, share=None, full_width: bool = True, scale: float = 1.0):
    """The rotate-half form's full-width cos/sin [T, D] of ``positions`` (``share(positions)``
    under CP), computed by the first layer of a forward that asks and reused by the rest, as
    transformers computes its position embeddings once per forward; with ``full_width=False``
    the [T, D/2] tables ``rope_cos_sin`` makes (what ``apply_rope`` takes).

    Args:
        forward_batch: the batch (the table lives as long as its forward: ``per_forward``).
        key: ``rope_key(inv_freq)``, taken at construction.
        positions: the batch's positions, every token's of the DP rank; the table is reused
            only for this very tensor.
        inv_freq: the frequencies [D / 2].
        dtype: the table's dtype (q's).
        share: a CP share of the rows (``CpView.share``), or None.
        full_width: the full-width tables (False: the half-width ones).
        scale: cos and sin multiplied by it (``rope_cos_sin``).
    """
    def table():
        cos, sin = rope_cos_sin(positions if share is None else share(positions), inv_freq,
                                dtype, scale)
        if full_width:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return positions, cos, sin

    slot = ("rope", key, dtype, share is None, full_width) + ((scale,) if scale != 1.0 else ())
    made_for, cos, sin = forward_batch.per_forward(slot, table)
    if made_for is not positions:  # a layer given other positions than the forward's own
        _, cos, sin = table()
    return cos, sin


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotate-half RoPE over x [T, H, D] with full-width cos/sin [T, D]
    (``forward_cos_sin``)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleave: bool) -> torch.Tensor:
    """RoPE over x [T, H, D] with cos/sin [T, D/2].

    ``interleave``: pairs (x0, x1), (x2, x3), ... rotate together and the result is laid out
    de-interleaved (evens then odds), as HF's ``apply_rotary_pos_emb_interleave``; q and k use
    the same layout, so their dot products are those of the interleaved rotation. Otherwise
    the rotate-half form.
    """
    if interleave:
        cos, sin = cos[:, None, :], sin[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotate_half(x, torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1))


@dataclass(frozen=True)
class YarnRope:
    """YaRN's parameters as a model's config reader gives them (each architecture reads its
    rope dicts its own way): ``yarn_frequencies``' keywords."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def frequencies(self, theta: float, dim: int) -> tuple[torch.Tensor, float]:
        """YaRN's inverse frequencies for ``theta`` and ``dim``, and its cos/sin scale."""
        return yarn_frequencies(theta, dim, **asdict(self))
