"""A toy stack for boundary tests: real stages and norms, tiny seeded compute.

Attention compute returns a rank-specific partial sum (x @ A[rank]), as a row-parallel output
projection does, so the full result over the attention-TP group is x @ sum_r A[r]; FFN
compute honours the exit's flags through a real RowParallelLinear over TP. The same stack
runs at world 1 and under tensor parallelism with attention DP, on the same tokens: a DP
rank holds its segment of the world-1 batch (``DpBatch``).
"""

from __future__ import annotations

import torch
from torch import nn

from layer_boundary import HandoffOutput, declare_attn, declare_ffn, layer_stack, make_stages
from layer_boundary.ops import cp_shares
from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual.add_norm import PlainAdd
from layer_boundary.runtime import (BatchVariant, BoundaryRuntime, ForwardBatch, ForwardMode,
                                    ParallelDims, RMSNorm, RowParallelLinear, build_parallel)

HIDDEN = 8


class AddAtProducer(PlainAdd):
    """The plain add, applied at the producer's exit (capabilities declared again: a subclass
    inherits none)."""

    plain = True
    portable = True
    at_producer = True


def runtime(tp: int = 1, dp: int = 1, cp: int = 1, **kwargs) -> BoundaryRuntime:
    """A runtime on ``tp`` ranks, ``dp`` attention-DP ranks and ``cp`` attention-CP ranks (a
    CP topology serves CP batches)."""
    if cp > 1:
        kwargs.setdefault("batch_variants", (BatchVariant.CP,))
    return BoundaryRuntime(build_parallel(ParallelDims(world_size=tp, tp=tp, attn_dp=dp,
                                                       attn_cp=cp)), **kwargs)


def batch(tokens: int = 3) -> ForwardBatch:
    return ForwardBatch.build(ForwardMode.EXTEND, [list(range(tokens))], [0])


class DpBatch:
    """This rank's share of a world-1 batch of ``sum(counts)`` tokens: DP rank d holds the
    d-th segment (``counts[d]`` tokens, possibly none).

    On a CP topology it is a CP batch: ``request_lens`` (every DP rank's requests, default
    one request per DP rank) place each CP rank's share, and ``share`` holds the world-1 rows
    of this rank's share (the mapping, ``cp_shares``)."""

    def __init__(self, counts: tuple[int, ...], rt: BoundaryRuntime, request_lens=None) -> None:
        par = rt.parallel
        self.counts = tuple(counts) if par.dims.attn_dp > 1 else (sum(counts),)
        d = par.attn_dp_rank if par.dims.attn_dp > 1 else 0
        self.start = sum(self.counts[:d])
        self.rows = slice(self.start, self.start + self.counts[d])
        n = self.counts[d]
        if par.dims.attn_cp == 1:
            self.share = None
            self.fb = ForwardBatch.build(ForwardMode.EXTEND, [list(range(n))] if n else [],
                                         [0] if n else [], dp_token_counts=self.counts)
            return
        lens = tuple(tuple(per) for per in request_lens) if request_lens is not None else \
            tuple((c,) if c else () for c in counts)
        starts = [sum(lens[d][:i]) for i in range(len(lens[d]))]
        self.fb = ForwardBatch.build(ForwardMode.EXTEND,
                                     [list(range(s, s + k)) for s, k in zip(starts, lens[d])],
                                     [0] * len(lens[d]), dp_token_counts=self.counts)
        self.fb.variant, self.fb.dp_request_lens = BatchVariant.CP, lens
        mine = cp_shares(lens[d], par.dims.attn_cp)[par.attn_cp_rank]
        self.share = torch.tensor(mine, dtype=torch.long) + self.start

    def mine(self, full: torch.Tensor) -> torch.Tensor:
        """This DP rank's rows of a world-1 tensor."""
        return full[self.rows]


def attn_weights(tp: int, seed: int = 0) -> torch.Tensor:
    """[tp, HIDDEN, HIDDEN]: one partial weight per rank."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tp, HIDDEN, HIDDEN, generator=gen) * 0.3


def seeded(shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def toy_norm(seed: int) -> RMSNorm:
    norm = RMSNorm(HIDDEN)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * attn_weights(1, seed)[0, 0])
    return norm


class ToyLayer(nn.Module):
    def __init__(self, rt: BoundaryRuntime, layer_id: int, num_layers: int, ffn_update=None,
                 ffn_reduction=None, fusions=None, attn_read=None, ffn_read=None,
                 ffn_sparse=False, attn_update=None, stack=None, first: int = 0):
        super().__init__()
        par = rt.parallel
        self.attn_norm, self.ffn_norm = toy_norm(100 + layer_id), toy_norm(200 + layer_id)
        # four fixed parts dealt over the attention-TP ranks: the same sum at every topology
        group = par.attn_tp_group
        self.a = attn_weights(4, seed=layer_id)[group.rank::group.size].sum(0)
        self.down = RowParallelLinear(2 * HIDDEN, HIDDEN, par.tp_group)
        full = attn_weights(2, seed=50 + layer_id).transpose(0, 1).reshape(HIDDEN, 2 * HIDDEN)
        self.down.weight_loader(self.down.weight, full)  # the same [H, 2H] weight at every tp
        kwargs = {} if ffn_reduction is None else {"reduction": ffn_reduction}
        if ffn_sparse:  # every FFN sparse: each declares the next one sparse too
            kwargs.update(sparse=True, next_sparse=True)
        ffn = declare_ffn(update=ffn_update, read=ffn_read, **kwargs)
        attn = declare_attn(read=attn_read, update=attn_update)
        options = {} if fusions is None else {"fusions": fusions}
        self.attn, self.ffn = make_stages(
            (attn, self.attn_norm, options), (ffn, self.ffn_norm, options),
            previous=None if layer_id == first else ffn,
            terminal=layer_id == first + num_layers - 1, runtime=rt, name=f"layer{layer_id}",
            stack=stack)

    def attn_compute(self, x):
        return x @ self.a

    def forward_layer(self, h, fb):
        """One decoder layer through its boundaries (the model side of the contract)."""
        return self.ffn_half(self.attn_half(h, fb), fb)

    def attn_half(self, h, fb, **prepare_kwargs):
        h = self.attn.prepare(h, fb, **prepare_kwargs)
        return self.attn.finish(self.attn_compute(h), fb)

    def ffn_half(self, h, fb):
        h = self.ffn.prepare(h, fb)
        with self.ffn.exit(fb) as out:
            y = self.ffn_compute(h)
        return out.finish(y)

    def ffn_compute(self, x):
        return self.down(local_slice(torch.tanh(x).repeat(1, 2), self.down))


class ToyStack:
    """``layers`` toy layers and a final norm on one runtime."""

    def __init__(self, rt: BoundaryRuntime, layers: int = 3, **layer_kwargs) -> None:
        with layer_stack(rt) as self.stack:
            self.layers = [ToyLayer(rt, i, layers, **layer_kwargs) for i in range(layers)]
        self.final_norm = toy_norm(300)

    def final(self, h, fb, **kwargs):
        return residual_batch.norm(h, fb, self.final_norm, **kwargs)


def local_slice(full_input: torch.Tensor, linear: RowParallelLinear) -> torch.Tensor:
    """This rank's input columns of a row-parallel linear (what a column-parallel layer gives)."""
    k = linear.in_per_rank
    return full_input[:, linear.group.rank * k:(linear.group.rank + 1) * k]


class ToyFfn:
    """tanh, then a real RowParallelLinear over TP (it honours the exit's flags); the same
    function at every topology for a given seed."""

    def __init__(self, par, seed: int) -> None:
        self.down = RowParallelLinear(2 * HIDDEN, HIDDEN, par.tp_group)
        full = attn_weights(2, seed).transpose(0, 1).reshape(HIDDEN, 2 * HIDDEN)
        self.down.weight_loader(self.down.weight, full)

    def __call__(self, x):
        return self.down(local_slice(torch.tanh(x).repeat(1, 2), self.down))


class ToyHandoff(HandoffOutput):
    """A finalize handoff whose unfused completion doubles the value."""

    def __init__(self, value):
        self.value = value

    def complete(self):
        return self.value * 2.0


class ToyAttn:
    """x @ A as partial sums dealt over the attention-TP ranks (a PARTIAL output)."""

    def __init__(self, par, seed: int) -> None:
        self.a = attn_weights(4, seed)[par.attn_tp_group.rank::par.attn_tp_group.size].sum(0)

    def __call__(self, x):
        return x @ self.a


def cp_case_id(tp: int, dp: int, cp: int, policy: str, lens) -> str:
    """A test id for a CP case: its topology, policy and every DP rank's request lengths."""
    per_dp = "-".join("_".join(map(str, per)) or "none" for per in lens)
    return f"tp{tp}-dp{dp}-cp{cp}-{policy}-{per_dp}"


def through_layers(layers, h, fb, accessors: bool):
    """``layers`` (each ``layer(h, fb, **capture)``) over ``h``; with ``accessors`` the model
    also completes layer 0's FFN sum on local rows (``complete_output``) and captures layer 1's
    updated residual, then tries a snapshot. Returns (h, [captured], the snapshot's refusal or
    None)."""
    captured, refused = [], None
    for i, layer in enumerate(layers):
        capture = ({"capture_output": lambda v, owned: captured.append(v.clone())}
                   if accessors and i == 1 else {})
        h = layer(h, fb, **capture)
        if accessors and i == 0:
            h = residual_batch.complete_output(h, fb)
    if accessors:
        try:
            residual_batch.snapshot(h, fb)
        except RuntimeError as e:
            refused = str(e)
    return h, captured, refused
