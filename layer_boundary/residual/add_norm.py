"""Plain residual add and the add+norm read (DESIGN.md, Numerics).

The sum of producer output and residual is formed in fp32; the stored residual is rounded to
the model dtype, and the norm reads the fp32 sum, not the rounded residual.
"""

from __future__ import annotations

import torch

from . import ReadKind, declared, is_plain

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
    """The norm of the updated residual. A plain add is formed in fp32 here; an update that
    is not plain is applied, then read, unless it declares ``apply_fp32(residual,
    contribution)`` (its updated residual in fp32, unrounded: ``ScaledAdd``), which is read
    as the plain add's sum is (rounded once for the residual, the norm reading it unrounded).
    """

    before_gather = False
    kind = ReadKind.ADD_NORM

    def enter(self, hidden, norm):
        return norm(hidden), hidden

    def read(self, residual, norm):
        return norm(residual), residual

    def update_and_read(self, update, residual, contribution, norm):
        if update is not PLAIN_ADD and not is_plain(update):
            # an update that declares its fp32 sum (``ScaledAdd``) is read as the plain add
            # is: the sum rounded once for the residual, the norm reading it unrounded;
            # any other is applied (rounded), then read
            apply_fp32 = declared(update, "apply_fp32")
            if apply_fp32 is not None:
                total = apply_fp32(residual, contribution)
                dtype = (contribution if residual is None else residual).dtype
                return norm.normalize_fp32(total, dtype), total.to(dtype=dtype)
            if residual is not None:
                return self.read(update.apply(residual, contribution), norm)
        if residual is None:
            return norm(contribution), contribution
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
