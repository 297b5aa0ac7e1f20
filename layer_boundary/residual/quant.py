"""The quantized read: the add+norm read (its fp32 accumulation kept), then dynamic FP8 of
the normalized input per token and per group of channels (``runtime/quant.py``).

Its compute input is a ``QuantizedInput``; the residual it leaves is the unquantized one, so
captures, accessors and the residual stream never see the quantization. It composes the
add+norm read rather than subclassing it, and declares its own kind: no fused add+norm
candidate (which stands in for ``kind == "add_norm"``) may replace it.
"""

from __future__ import annotations

from ..runtime.arguments import positive_int
from ..runtime.quant import quantize_groups
from .add_norm import ADD_NORM_READ


class QuantizedRead:
    before_gather = False
    kind = "fp8_add_norm"

    def __init__(self, group: int = 128) -> None:
        # the channels each FP8 scale covers (config.json's weight_block_size[1])
        self.group = positive_int("QuantizedRead", "group", group)

    def enter(self, hidden, norm):
        x, residual = ADD_NORM_READ.enter(hidden, norm)
        return quantize_groups(x, self.group), residual

    def read(self, residual, norm):
        x, residual = ADD_NORM_READ.read(residual, norm)
        return quantize_groups(x, self.group), residual

    def update_and_read(self, update, residual, contribution, norm):
        x, residual = ADD_NORM_READ.update_and_read(update, residual, contribution, norm)
        return quantize_groups(x, self.group), residual

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group={self.group})"
