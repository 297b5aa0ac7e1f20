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

import functools

import torch
import triton
import triton.language as tl

from ..runtime.kernel_ops import compiled_as_op

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # fp32 accumulation suffices


def _device(fn):
    """``triton.jit`` for a function the kernels call (never launched). Under the interpreter
    each call of a jitted function patches ``triton.language`` again, which the launch has
    done already for the whole grid: with ``_rounded`` called seven times a program, that
    patching was a third of the interpreted kernels' time (a twentieth of the test suite's).
    There the kernels call the interpreter's own rewrite of the function instead, patched once
    by their launch; compiled, this is ``triton.jit``."""
    jitted = triton.jit(fn)
    rewrite = getattr(jitted, "rewrite", None)  # the interpreter's InterpretedFunction
    if rewrite is None:
        return jitted

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return rewrite()(*args, **kwargs)  # rewritten once, then a dict lookup

    return call


@_device
def _rounded(x, out_ty: tl.constexpr, BF16: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``out_ty``, as torch rounds. For bf16 the bits
    are rounded by hand: the Triton interpreter's bf16 cast truncates (compiled kernels
    round to nearest-even, so both agree with torch)."""
    if BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # a NaN stays NaN
    return x.to(out_ty)


@_device
def _add_and_norm(value_ptr, residual_ptr, weight_ptr, residual_out_ptr, row, cols, n_cols,
                  value_stride, residual_stride, eps, ZERO_CENTERED: tl.constexpr,
                  BF16: tl.constexpr):
    """One row: the fp32 sum, the residual stored rounded, and the norm's output (rounded to
    the residual's dtype, returned in fp32); ``cols`` past ``n_cols`` load as 0."""
    inside = cols < n_cols
    value = tl.load(value_ptr + row * value_stride + cols, mask=inside, other=0.0)
    residual = tl.load(residual_ptr + row * residual_stride + cols, mask=inside, other=0.0)
    total = value.to(tl.float32) + residual.to(tl.float32)
    out_ty = residual_out_ptr.dtype.element_ty
    tl.store(residual_out_ptr + row * n_cols + cols, _rounded(total, out_ty, BF16), mask=inside)
    variance = tl.sum(total * total, axis=0) / n_cols  # padding columns add nothing
    normed = total * (1.0 / tl.sqrt(variance + eps))
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if ZERO_CENTERED:  # scaled in fp32, rounded once
        out = _rounded(normed * (1.0 + weight), out_ty, BF16)
    else:  # rounded, then scaled in the model dtype: the product of two rounded values
        # is exact in fp32, so rounding it once is the model dtype's own multiply
        out = _rounded(_rounded(normed, out_ty, BF16).to(tl.float32) * weight, out_ty, BF16)
    return out.to(tl.float32)


@triton.jit
def _add_rms_norm(value_ptr, residual_ptr, weight_ptr, normed_ptr, residual_out_ptr,
                  n_cols, value_stride, residual_stride, eps,
                  ZERO_CENTERED: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    out = _add_and_norm(value_ptr, residual_ptr, weight_ptr, residual_out_ptr, row, cols,
                        n_cols, value_stride, residual_stride, eps, ZERO_CENTERED, BF16)
    tl.store(normed_ptr + row * n_cols + cols, out.to(normed_ptr.dtype.element_ty),
             mask=cols < n_cols)


@_device
def _rounded_e4m3(x):
    """fp32 ``x`` (|x| <= 448) rounded to nearest-even among float8_e4m3fn values, still in
    fp32 (the cast that follows is exact). By hand: the interpreter's fp8 cast does not
    carry a rounded-up mantissa into the exponent."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = (bits + (((bits >> 20) & 1) + 0x7FFFF)) & 0xFFF00000  # 3 mantissa bits
    normal = normal.to(tl.float32, bitcast=True)
    # below 2^-6 the values are multiples of 2^-9: fp32's own nearest-even addition rounds
    # |x| * 2^9 to an integer (2^23: the first fp32 with no fraction bits)
    tiny = ((tl.abs(x) * 512.0 + 8388608.0) - 8388608.0) * (1.0 / 512.0)
    tiny = tl.where(x < 0, -tiny, tiny)
    return tl.where(tl.abs(x) < 0.015625, tiny, normal)


@triton.jit
def _add_rms_norm_fp8(value_ptr, residual_ptr, weight_ptr, values_ptr, scales_ptr,
                      residual_out_ptr, n_cols, n_groups, value_stride, residual_stride, eps,
                      ZERO_CENTERED: tl.constexpr, BF16: tl.constexpr, GROUP: tl.constexpr,
                      GROUPS: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, GROUPS * GROUP)
    inside = cols < n_cols
    x = _add_and_norm(value_ptr, residual_ptr, weight_ptr, residual_out_ptr, row, cols, n_cols,
                      value_stride, residual_stride, eps, ZERO_CENTERED, BF16)
    # per group of GROUP channels (padding columns are 0: a partial group's amax is its own)
    x = tl.reshape(x, (GROUPS, GROUP))
    amax = tl.max(tl.abs(x), axis=1)
    scales = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)),
                      1.0)
    q = tl.math.div_rn(x, tl.broadcast_to(scales[:, None], (GROUPS, GROUP)))
    q = _rounded_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0))
    q = tl.reshape(q, (GROUPS * GROUP,))
    tl.store(values_ptr + row * n_cols + cols, q.to(values_ptr.dtype.element_ty), mask=inside)
    groups = tl.arange(0, GROUPS)
    tl.store(scales_ptr + row * n_groups + groups, scales, mask=groups < n_groups)


def _quantized_shapes(value, residual, weight, eps, group, zero_centered=False):
    rows, width = residual.shape
    return (residual.new_empty((rows, width), dtype=torch.float8_e4m3fn),
            residual.new_empty((rows, -(-width // group)), dtype=torch.float32),
            torch.empty_like(residual, memory_format=torch.contiguous_format))


@compiled_as_op("add_rms_norm_fp8", _quantized_shapes)
def add_rms_norm_fp8(value: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, group: int, zero_centered: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` with its normalized output quantized to FP8 per token and ``group``
    channels, as ``runtime.quant.quantize_groups`` does: ``(values [T, D] float8_e4m3fn,
    scales [T, ceil(D / group)] float32, new residual)``. ``group`` is a power of two."""
    rows, width = residual.shape
    n_groups = -(-width // group)
    values, scales, new_residual = _quantized_shapes(value, residual, weight, eps, group)
    if rows == 0:
        return values, scales, new_residual
    if value.stride(-1) != 1:
        value = value.contiguous()
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    _add_rms_norm_fp8[(rows,)](value, residual, weight.contiguous(), values, scales,
                               new_residual, width, n_groups, value.stride(0),
                               residual.stride(0), eps, ZERO_CENTERED=zero_centered,
                               BF16=residual.dtype == torch.bfloat16, GROUP=group,
                               GROUPS=triton.next_power_of_2(n_groups),
                               num_warps=_fp8_warps(width))
    return values, scales, new_residual


def _fp8_warps(width: int) -> int:
    """Warps a program of the FP8 kernel: its per-group max, IEEE divisions and rounding
    keep a row's threads busier than the plain add+norm's (at 0.66 of copy bandwidth with
    Triton's default 4 on an H200, hidden 4096); more warps a row hide that behind the
    loads, as row-wise norm kernels commonly size them (scripts/gpu_check.py times 4, 8 and
    16 to confirm). The interpreter ignores it."""
    return 4 if width < 2048 else 8 if width < 8192 else 16


def _normed_shapes(value, residual, weight, eps, zero_centered=False):
    normed = torch.empty_like(residual, memory_format=torch.contiguous_format)
    return normed, torch.empty_like(normed)


@compiled_as_op("add_rms_norm", _normed_shapes)
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
    normed, new_residual = _normed_shapes(value, residual, weight, eps)
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


@triton.jit
def _head_norm_rope(x_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr, x_row, x_head, out_row,
                    out_head, cs_row, eps, D: tl.constexpr, HALF: tl.constexpr,
                    BF16: tl.constexpr):
    """A program per (token, head): the head's RMSNorm (fp32, rounded, times the weight in
    the dtype, rounded) then rotate-half RoPE (each product and the sum rounded), the ops of
    ``RMSNorm`` and ``rope.rotate_half`` in their order, so the numbers are theirs."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    dims = tl.arange(0, D)
    rot = (dims + HALF) % D  # rotate_half's source of each output dim
    x = tl.load(x_ptr + t * x_row + h * x_head + dims).to(tl.float32)
    x_rot = tl.load(x_ptr + t * x_row + h * x_head + rot).to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    out_ty = out_ptr.dtype.element_ty
    w = tl.load(weight_ptr + dims).to(tl.float32)
    w_rot = tl.load(weight_ptr + rot).to(tl.float32)
    y = _rounded(w * _rounded(x * scale, out_ty, BF16).to(tl.float32), out_ty, BF16)
    y_rot = _rounded(w_rot * _rounded(x_rot * scale, out_ty, BF16).to(tl.float32), out_ty, BF16)
    y_rot = tl.where(dims < HALF, -y_rot.to(tl.float32), y_rot.to(tl.float32))
    cos = tl.load(cos_ptr + t * cs_row + dims).to(tl.float32)
    sin = tl.load(sin_ptr + t * cs_row + dims).to(tl.float32)
    a = _rounded(y.to(tl.float32) * cos, out_ty, BF16).to(tl.float32)
    b = _rounded(y_rot * sin, out_ty, BF16).to(tl.float32)
    tl.store(out_ptr + t * out_row + h * out_head + dims, _rounded(a + b, out_ty, BF16))


def _head_shape(x, weight, eps, cos, sin):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@compiled_as_op("head_norm_rope", _head_shape)
def head_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """``rotate_half(RMSNorm(x), cos, sin)`` per head in one launch: x [T, H, D] (rows may be
    strided, each head's dims contiguous; D a power of two), weight [D], cos/sin [T, D] in
    x's dtype. Returns a new [T, H, D]."""
    tokens, heads, dim = x.shape
    out = _head_shape(x, weight, eps, cos, sin)
    if tokens and heads:
        cos, sin = cos.contiguous(), sin.contiguous()
        _head_norm_rope[(tokens, heads)](x, weight.contiguous(), cos, sin, out, x.stride(0),
                                         x.stride(1), out.stride(0), out.stride(1),
                                         cos.stride(0), eps, D=dim, HALF=dim // 2,
                                         BF16=x.dtype == torch.bfloat16)
    return out


@triton.jit
def _silu_mul(gate_ptr, up_ptr, out_ptr, gate_row, up_row, out_row, n_cols,
              BLOCK: tl.constexpr, BF16: tl.constexpr):
    """A program per token row: ``silu(gate) * up`` as torch computes the two ops, silu in
    fp32 rounded to the dtype, then the product rounded; a row's numbers never depend on the
    rows beside it."""
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    out_ty = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + t * gate_row + cols, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + t * up_row + cols, mask=inside, other=0.0).to(tl.float32)
    act = _rounded(g / (1.0 + tl.exp(-g)), out_ty, BF16).to(tl.float32)
    tl.store(out_ptr + t * out_row + cols, _rounded(act * u, out_ty, BF16), mask=inside)


def _product_shape(gate, up):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@compiled_as_op("silu_mul", _product_shape)
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` in one launch: gate and up [T, I] of one dtype (rows may be
    strided, each row contiguous). Returns a new [T, I]."""
    tokens, width = gate.shape
    out = _product_shape(gate, up)
    if tokens and width:
        if gate.stride(-1) != 1:
            gate = gate.contiguous()
        if up.stride(-1) != 1:
            up = up.contiguous()
        _silu_mul[(tokens,)](gate, up, out, gate.stride(0), up.stride(0), out.stride(0), width,
                             BLOCK=triton.next_power_of_2(width),
                             BF16=gate.dtype == torch.bfloat16)
    return out
