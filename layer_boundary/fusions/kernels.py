"""Triton kernels for the arrival of a completed sum: residual add + RMSNorm in one pass.

One program per token row: it reads the completed value and the residual, sums them in fp32,
writes the new residual rounded to its dtype, and normalises the fp32 sum (DESIGN.md,
Numerics: the norm reads the fp32 sum, not the rounded residual). Two norm forms:

- ``RMSNorm`` (HF): ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``, rounded, then scaled;
- the zero-centered (Gemma) norm: ``(x * rsqrt(mean(x^2) + eps) * (1 + w)).to(dtype)``, scaled
  in fp32, then rounded once.

On a CUDA device the kernels compile; on the CPU they run under the Triton interpreter, which
must be chosen before ``triton`` is first imported (``TRITON_INTERPRET=1``:
``fusions.triton_provider.use_interpreter``). This module imports ``triton`` at import: only
the Triton provider imports it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # fp32 accumulation suffices


@triton.jit
def _rounded(x, out_ty: tl.constexpr, BF16: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``out_ty``, as torch rounds. For bf16 the bits
    are rounded by hand: the Triton interpreter's bf16 cast truncates (compiled kernels
    round to nearest-even, so both agree with torch)."""
    if BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # a NaN stays NaN
    return x.to(out_ty)


@triton.jit
def _add_rms_norm(value_ptr, residual_ptr, weight_ptr, normed_ptr, residual_out_ptr,
                  n_cols, value_stride, residual_stride, eps,
                  ZERO_CENTERED: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    value = tl.load(value_ptr + row * value_stride + cols, mask=inside, other=0.0)
    residual = tl.load(residual_ptr + row * residual_stride + cols, mask=inside, other=0.0)
    total = value.to(tl.float32) + residual.to(tl.float32)
    out_ty = residual_out_ptr.dtype.element_ty
    tl.store(residual_out_ptr + row * n_cols + cols, _rounded(total, out_ty, BF16), mask=inside)
    variance = tl.sum(total * total, axis=0) / n_cols  # padding columns load as 0
    normed = total * (1.0 / tl.sqrt(variance + eps))
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if ZERO_CENTERED:  # scaled in fp32, rounded once
        out = _rounded(normed * (1.0 + weight), out_ty, BF16)
    else:  # rounded, then scaled in the model dtype: the product of two rounded values
        # is exact in fp32, so rounding it once is the model dtype's own multiply
        out = _rounded(_rounded(normed, out_ty, BF16).to(tl.float32) * weight, out_ty, BF16)
    tl.store(normed_ptr + row * n_cols + cols, out, mask=inside)


def add_rms_norm(value: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(value + residual), value + residual)``, the sum formed in fp32, both outputs in
    ``residual``'s dtype and on new storage.

    Args:
        value: the completed contribution [T, D] (any dtype the kernel loads; rows may be
            strided, the last dim contiguous).
        residual: the residual [T, D] on the same rows.
        weight: the norm's weight [D] (``gemma_weight`` where ``zero_centered``).
        eps: the norm's epsilon.
        zero_centered: the Gemma form (scale by ``1 + w`` in fp32, round once).
    """
    rows, width = residual.shape
    normed = torch.empty_like(residual, memory_format=torch.contiguous_format)
    new_residual = torch.empty_like(normed)
    if rows == 0:
        return normed, new_residual
    if value.stride(-1) != 1:
        value = value.contiguous()
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    _add_rms_norm[(rows,)](value, residual, weight.contiguous(), normed, new_residual, width,
                           value.stride(0), residual.stride(0), eps,
                           ZERO_CENTERED=zero_centered, BF16=residual.dtype == torch.bfloat16,
                           BLOCK=triton.next_power_of_2(width))
    return normed, new_residual
