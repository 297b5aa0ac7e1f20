"""Plain residual add and the add+norm read (DESIGN.md, Numerics).

The sum of producer output and residual is formed in fp32; the stored residual is rounded to
the model dtype, and the norm reads the fp32 sum, not the rounded residual.
"""

from __future__ import annotations

import torch


class PlainAdd:
    plain = True
    at_producer = False

    def apply(self, residual, contribution):
        if residual is None:
            return contribution
        return (residual.float() + contribution.float()).to(residual.dtype)

    def __repr__(self) -> str:
        return "PlainAdd()"


class AddNormRead:
    before_gather = False

    def enter(self, hidden, norm):
        return norm(hidden), hidden

    def read(self, residual, norm):
        return norm(residual), residual

    def update_and_read(self, update, residual, contribution, norm):
        if residual is None:
            return norm(contribution), contribution
        if not update.plain:
            return self.read(update.apply(residual, contribution), norm)
        total = residual.float() + contribution.float()
        return norm.normalize_fp32(total, residual.dtype), total.to(residual.dtype)

    def __repr__(self) -> str:
        return "AddNormRead()"


PLAIN_ADD = PlainAdd()
ADD_NORM_READ = AddNormRead()
