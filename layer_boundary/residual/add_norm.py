"""Plain residual add and the add+norm read (DESIGN.md, Numerics).

The sum of producer output and residual is formed in fp32; the stored residual is rounded to
the model dtype, and the norm reads the fp32 sum, not the rounded residual.
"""

from __future__ import annotations

import torch

from . import ReadKind, is_plain

# filled once at import and never written again: a memo written during a forward would
# change what a compiled graph guards on, and recompile it
FP32 = torch.float32
ACCUMULATE = {dtype: torch.promote_types(dtype, torch.float32)
              for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


# Casts are written ``.to(dtype=...)``: the keyword form skips ``Tensor.to``'s overload
# matching, a few hundred nanoseconds per call, which at decode sizes is most of a cast.


def accumulate_dtype(dtype):
    """fp32 for half and single precision; wider types keep their own precision."""
    acc = ACCUMULATE.get(dtype)
    return torch.promote_types(dtype, torch.float32) if acc is None else acc


class Fp32Norm:
    """Adapter for a norm without an fp32 entry point: rounds the fp32 sum, then normalises."""

    def __init__(self, norm) -> None:
        self.norm = norm

    def __call__(self, x):
        return self.norm(x)

    def normalize_fp32(self, x32, out_dtype):
        return self.norm(x32.to(out_dtype))


class PlainAdd:
    plain = True
    portable = True  # stateless
    at_producer = False

    def apply(self, residual, contribution):
        if residual is None:
            return contribution
        if residual.dtype is FP32 and contribution.dtype is FP32:  # no casts
            return residual + contribution
        acc = accumulate_dtype(residual.dtype)
        return (residual.to(dtype=acc) + contribution.to(dtype=acc)).to(dtype=residual.dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AddNormRead:
    before_gather = False
    kind = ReadKind.ADD_NORM

    def enter(self, hidden, norm):
        return norm(hidden), hidden

    def read(self, residual, norm):
        return norm(residual), residual

    def update_and_read(self, update, residual, contribution, norm):
        if residual is None:
            return norm(contribution), contribution
        if update is not PLAIN_ADD and not is_plain(update):
            return self.read(update.apply(residual, contribution), norm)
        dtype = residual.dtype
        if dtype is FP32 and contribution.dtype is FP32:  # the sum is fp32 already: no casts
            total = residual + contribution
            return norm.normalize_fp32(total, dtype), total
        acc = ACCUMULATE.get(dtype) or accumulate_dtype(dtype)
        total = residual.to(dtype=acc) + contribution.to(dtype=acc)
        return norm.normalize_fp32(total, dtype), total.to(dtype=dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


PLAIN_ADD = PlainAdd()
ADD_NORM_READ = AddNormRead()
