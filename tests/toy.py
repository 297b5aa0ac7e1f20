"""A toy stack for boundary tests: real stages and norms, tiny seeded compute.

Attention compute returns a rank-specific partial sum (x @ A[rank]), as a row-parallel output
projection does, so the full result is x @ sum_r A[r]; FFN compute honours the exit's flags
through a real RowParallelLinear.
"""

from __future__ import annotations

import torch
from torch import nn

from layer_boundary import declare_attn, declare_ffn, make_stages
from layer_boundary.runtime.args import BoundaryRuntime
from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode
from layer_boundary.runtime.linear import RowParallelLinear
from layer_boundary.runtime.norm import RMSNorm
from layer_boundary.runtime.parallel import ParallelDims, build_parallel

HIDDEN = 8


def runtime(tp: int = 1, **kwargs) -> BoundaryRuntime:
    return BoundaryRuntime(build_parallel(ParallelDims(world_size=tp, tp=tp)), **kwargs)


def batch(tokens: int = 3) -> ForwardBatch:
    return ForwardBatch.build(ForwardMode.EXTEND, [list(range(tokens))], [0])


def attn_weights(tp: int, seed: int = 0) -> torch.Tensor:
    """[tp, HIDDEN, HIDDEN]: one partial weight per rank."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tp, HIDDEN, HIDDEN, generator=gen) * 0.3


class ToyLayer(nn.Module):
    def __init__(self, rt: BoundaryRuntime, layer_id: int, num_layers: int, ffn_update=None,
                 ffn_reduction=None, fusions=None):
        super().__init__()
        par = rt.parallel
        self.attn_norm, self.ffn_norm = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        with torch.no_grad():
            self.attn_norm.weight.copy_(1 + 0.1 * attn_weights(1, 100 + layer_id)[0, 0])
            self.ffn_norm.weight.copy_(1 + 0.1 * attn_weights(1, 200 + layer_id)[0, 0])
        # four fixed parts, dealt over the ranks: the full sum is the same at tp 1, 2 and 4
        self.a = attn_weights(4, seed=layer_id)[par.tp.rank::par.tp.size].sum(0)
        self.down = RowParallelLinear(2 * HIDDEN, HIDDEN, par.tp)
        full = attn_weights(2, seed=50 + layer_id).transpose(0, 1).reshape(HIDDEN, 2 * HIDDEN)
        self.down.weight_loader(self.down.weight, full)  # the same [H, 2H] weight at every tp
        kwargs = {} if ffn_reduction is None else {"reduction": ffn_reduction}
        ffn = declare_ffn(update=ffn_update, **kwargs)
        options = {} if fusions is None else {"fusions": fusions}
        self.attn, self.ffn = make_stages(
            (declare_attn(), self.attn_norm, options), (ffn, self.ffn_norm, options),
            previous=None if layer_id == 0 else ffn,
            terminal=layer_id == num_layers - 1, runtime=rt, name=f"layer{layer_id}")

    def attn_compute(self, x):
        return x @ self.a

    def forward_layer(self, h, fb):
        """One decoder layer through its boundaries (the model side of the contract)."""
        h = self.attn.prepare(h, fb)
        h = self.attn.finish(self.attn_compute(h), fb)
        h = self.ffn.prepare(h, fb)
        with self.ffn.exit(fb) as out:
            y = self.ffn_compute(h)
        return out.finish(y)

    def ffn_compute(self, x):
        return self.down(local_slice(torch.tanh(x).repeat(1, 2), self.down))


def local_slice(full_input: torch.Tensor, linear: RowParallelLinear) -> torch.Tensor:
    """This rank's input columns of a row-parallel linear (what a column-parallel layer gives)."""
    k = linear.in_per_rank
    return full_input[:, linear.group.rank * k:(linear.group.rank + 1) * k]
