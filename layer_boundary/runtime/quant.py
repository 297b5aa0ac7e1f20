"""FP8 (``float8_e4m3fn``) numbers: dynamic per-token, per-group activation quantization and
block-quantized weights, as the public FP8 checkpoints store them.

A quantized compute input is a ``QuantizedInput``: 1-byte values [T, H] and one float32 scale
per token and group of ``group`` channels [T, ceil(H / group)], the last group partial where
``group`` does not divide H (as the weights' last input block is); ``value * scale`` is the
input.
Row movements apply to both parts alike (the values cross ranks as bytes), so a gather of a
quantized input moves 1 byte per channel plus the scales, and the consumer receives exactly
what the read produced. On CPU a linear dequantizes it before its matmul.
"""

from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


class QuantizedInput:
    """A quantized compute input: ``values`` [T, H] float8, ``scales`` [T, ceil(H / group)]
    float32."""

    __slots__ = ("values", "scales", "group", "dtype")

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, group: int, dtype) -> None:
        self.values, self.scales, self.group = values, scales, group
        self.dtype = dtype  # what it dequantizes to: the activations' dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def new_zeros(self, shape) -> torch.Tensor:
        """Zeros in the activations' dtype (a rank's empty contribution, as a tensor's)."""
        return torch.zeros(shape, dtype=self.dtype, device=self.values.device)

    def map_rows(self, move) -> QuantizedInput:
        """Both parts through one row movement ``move(tensor)`` (the values as bytes)."""
        values = move(self.values.view(torch.uint8)).view(FP8)
        return QuantizedInput(values, move(self.scales), self.group, self.dtype)

    def dequantize(self) -> torch.Tensor:
        rows, width = self.values.shape
        if width % self.group:  # a partial last group
            scales = self.scales.repeat_interleave(self.group, dim=1)[:, :width]
            return (self.values.float() * scales).to(self.dtype)
        x = self.values.float().view(rows, width // self.group, self.group)
        return (x * self.scales.unsqueeze(-1)).view(rows, width).to(self.dtype)


def quantize_groups(x: torch.Tensor, group: int) -> QuantizedInput:
    """Dynamic FP8 of ``x`` [T, H]: per token and per ``group`` channels (the last group
    partial where ``group`` does not divide H), scale = amax / 448 (a zero group keeps scale
    1)."""
    rows, width = x.shape
    groups = -(-width // group)
    g = x.float()
    if groups * group != width:  # zero padding keeps a partial group's amax its own channels'
        g = torch.nn.functional.pad(g, (0, groups * group - width))
    g = g.view(rows, groups, group)
    amax = g.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    values = (g / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    values = values.view(rows, groups * group)[:, :width].contiguous()
    return QuantizedInput(values, scales, group, x.dtype)


def fake_quantize(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` [T, H] as a quantized read's consumer sees it: quantized by ``quantize_groups``
    and dequantized (for a stage that quantizes after it moved its unquantized input)."""
    return quantize_groups(x, group).dequantize()


def as_activations(x):
    """A linear's input as a tensor: a ``QuantizedInput`` dequantized, anything else as is."""
    return x.dequantize() if isinstance(x, QuantizedInput) else x


def check_block_scales(weight_shape: tuple, scale_shape: tuple, block: tuple[int, int],
                       name: str) -> None:
    """A ``weight_scale_inv`` of one scale per [bo, bi] block of its weight, or the error
    naming both tensors."""
    bo, bi = block
    want = tuple(math.ceil(n / b) for n, b in zip(weight_shape, (bo, bi)))
    if len(weight_shape) != 2 or tuple(scale_shape) != want:
        raise ValueError(f"{name}.weight_scale_inv has shape {list(scale_shape)}, but "
                         f"{name}.weight {list(weight_shape)} in {bo}x{bi} blocks needs "
                         f"{list(want)}")


# what a quantizer writes as block scales (safetensors' names); float8 or integer scales are
# not this format, and dequantizing them would give numbers no quantizer meant
SCALE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                "F64": torch.float64}


def check_scale_dtype(dtype, name: str) -> None:
    """A ``weight_scale_inv`` dtype (torch's or the safetensors header's string) a quantizer
    writes, or the error naming the tensor."""
    if dtype not in SCALE_DTYPES and dtype not in SCALE_DTYPES.values():
        raise ValueError(f"{name}.weight_scale_inv has dtype {dtype}; FP8 block scales are "
                         "floating point (F32, BF16, F16 or F64)")


def check_scale_values(scale_inv: torch.Tensor, name: str) -> None:
    """Block scales a quantizer writes (amax / 448 of a block: positive normal floats), or
    the error naming the tensor: a zero, negative, subnormal (1e-45 in fp32: its block's
    weights vanish) or non-finite scale would give wrong weights that still load."""
    scale = scale_inv.float()
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"{name}.weight_scale_inv holds non-finite values (NaN or Inf)")
    if scale.numel() and float(scale.min()) <= 0:
        raise ValueError(f"{name}.weight_scale_inv holds a scale <= 0 ({float(scale.min())}); "
                         "FP8 block scales are positive")
    tiny = torch.finfo(scale_inv.dtype).tiny  # the smallest normal number of its own dtype
    if scale.numel() and float(scale.min()) < tiny:
        raise ValueError(f"{name}.weight_scale_inv holds a subnormal scale "
                         f"({float(scale.min()):.3g}, below {scale_inv.dtype}'s smallest "
                         f"normal {tiny:.3g}); FP8 block scales are positive normal numbers")


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      name: str) -> torch.Tensor:
    """A block-quantized weight [out, in] (float8) times its ``weight_scale_inv``
    [ceil(out / bo), ceil(in / bi)]: the float32 weight."""
    check_scale_dtype(scale_inv.dtype, name)
    check_block_scales(tuple(weight.shape), tuple(scale_inv.shape), block, name)
    check_scale_values(scale_inv, name)
    out, inp = weight.shape
    bo, bi = block
    scales = scale_inv.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return weight.float() * scales
