"""Two decoder layers of your own on layer boundaries: tensor parallelism 2 against 1 rank."""

import torch
from torch import nn

from layer_boundary import append_stages, declare_attn, declare_ffn, layer_stack
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime import (BoundaryRuntime, ColumnParallelLinear, ForwardBatch,
                                    ForwardMode, ParallelDims, RMSNorm, RowParallelLinear,
                                    build_parallel, spawn)

H = 32  # hidden size


def linear(cls, n_in, n_out, group, seed, **kwargs):
    """A parallel linear holding its shard of one seeded full weight (the same at every tp)."""
    layer = cls(n_in, n_out, group, **kwargs)
    full = torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(seed)) / n_in**0.5
    layer.weight_loader(layer.weight, full)
    return layer


class Layer(nn.Module):
    def __init__(self, runtime, i):
        super().__init__()
        tp = runtime.parallel.tp_group
        # a token mixer standing in for attention: its output is a partial sum over tp ranks
        self.mix_in = linear(ColumnParallelLinear, H, H, tp, 10 * i)
        self.mix_out = linear(RowParallelLinear, H, H, tp, 10 * i + 1, reduce_results=False)
        self.up = linear(ColumnParallelLinear, H, 4 * H, tp, 10 * i + 2)
        self.down = linear(RowParallelLinear, 4 * H, H, tp, 10 * i + 3)  # obeys the exit
        self.attn, self.ffn = append_stages((declare_attn(), RMSNorm(H)),
                                            (declare_ffn(), RMSNorm(H)), name=f"layer{i}")

    def forward(self, h, fb):
        x = self.attn.prepare(h, fb)  # owed sum + residual add + norm
        h = self.attn.finish(self.mix_out(torch.tanh(self.mix_in(x))), fb)  # its sum stays owed
        x = self.ffn.prepare(h, fb)
        with self.ffn.exit(fb) as out:  # sum the output here, or leave it to the next input
            y = self.down(torch.relu(self.up(x)))
        return out.finish(y)


def run(tp: int) -> torch.Tensor:
    runtime = BoundaryRuntime(build_parallel(ParallelDims(world_size=tp, tp=tp)))
    with layer_stack(runtime):  # the stack knows each stage's neighbours
        layers = [Layer(runtime, i) for i in range(2)]
    final_norm = RMSNorm(H)
    fb = ForwardBatch.build(ForwardMode.EXTEND, [[1, 2, 3], [4, 5]], [0, 0])  # two prompts
    residual_batch.start(fb)
    h = torch.randn(fb.num_tokens, H, generator=torch.Generator().manual_seed(0))  # embedded
    for layer in layers:
        h = layer(h, fb)
    return residual_batch.norm(h, fb, final_norm)  # completes what is owed, leaves the stack


if __name__ == "__main__":
    one = run(1)
    two = spawn(run, 2, 2)  # two gloo ranks on this machine; each returns the whole output
    print(f"2 layers, 5 tokens: tp 2 matches 1 rank to {(two[0] - one).abs().max():.1e} "
          f"(both ranks equal: {torch.equal(two[0], two[1])})")
