"""Tensor-parallel linear layers that honour the boundary's forward flags.

Each layer owns the shard of the full weight that its group rank holds and a
``weight_loader(param, full_tensor[, shard_id])`` that cuts that shard from a checkpoint tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from .arguments import flag
from .collectives import all_reduce_rows, gather_last_dim
from .context import get_forward, sequence_parallel_scope
from .quant import QuantizedInput, as_activations
from .shards import read_columns, take, whole
from .packed import linear
from .parallel import Group


def _divide(n: int, d: int, what: str) -> int:
    if n % d != 0:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {d}")
    return n // d


def head_split(heads: int, tp: int, what: str) -> tuple[int, int]:
    """(heads each rank holds, ranks each head is replicated on) of ``heads`` attention heads
    over ``tp`` ranks: split evenly, or, where there are no more heads than ranks, each head
    on ``tp // heads`` consecutive ranks. ``what`` names them in the error."""
    if tp >= heads:
        if tp % heads:
            raise ValueError(f"{what} ({heads}) does not divide the tensor-parallel size {tp}: "
                             "a head cannot be replicated on whole ranks")
        return 1, tp // heads
    return _divide(heads, tp, what), 1


def expect_shape(loaded: torch.Tensor, *shape: int) -> None:
    """A checkpoint tensor has the full (unsharded) shape its layer implies, before any shard
    is taken from it: a larger tensor would otherwise load a slice of the wrong values."""
    if tuple(loaded.shape) != shape:
        raise RuntimeError(f"expected the full shape {shape}")


class ColumnParallelLinear(nn.Module):
    """y[:, shard] = x @ W[shard].T: output features split over ``group``; rows unchanged,
    except inside a sequence-parallel exit, where ``x`` holds this rank's scattered rows and
    is all-gathered first (the scope's movement; one gather per input shared by the
    compute's column-parallel linears)."""

    packs_weight = True  # runtime/packed.py: a CPU weight packed once at load

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False,
                 gather_output: bool = False, dtype=torch.float32, name: str = "linear"):
        super().__init__()
        flag(type(self).__name__, "bias", bias)  # a truthy string would build a bias
        self.group = group
        self.gather_output = flag(type(self).__name__, "gather_output", gather_output)
        self.lora = None  # adapters/lora.py attaches LoRA weights here
        self.packed = None  # runtime/packed.py: set by pack_linears after the load
        self.out_per_rank = _divide(out_features, group.size, f"{name} output size")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank, dtype=dtype),
                                     requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        expect_shape(loaded, self.out_per_rank * self.group.size, *param.shape[1:])
        start = self.group.rank * self.out_per_rank
        param.data.copy_(take(loaded, 0, start, self.out_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scope = sequence_parallel_scope()
        if scope is not None:
            scope.check_group(self.group, type(self).__name__)
            if isinstance(x, QuantizedInput):
                raise RuntimeError(f"a {type(self).__name__} in a sequence-parallel scope got a "
                                   "quantized input: quantized reads do not run in "
                                   "sequence-parallel batches yet")
            x = scope.gather(x)
        x = as_activations(x)  # a quantized read's values and scales, dequantized (CPU)
        y = linear(self, x, self.bias)
        if self.lora is not None:  # this rank's output features of each row's adapter delta
            y = self.lora(x, y)
        return gather_last_dim(y, self.group) if self.gather_output else y


# loaders that read only their shard of a CheckpointSlice (runtime/shards.py)
ColumnParallelLinear.weight_loader.reads_slices = True


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; query heads split over ``group``, kv heads split or replicated.

    When the group is larger than the number of kv heads, each kv head is replicated on
    ``group.size // num_kv_heads`` consecutive ranks.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 group: Group, bias: bool = False, dtype=torch.float32):
        tp = group.size
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        self.num_kv_heads, self.kv_replicas = head_split(num_kv_heads, tp, "num_key_value_heads")
        self.head_dim, self.total_heads, self.total_kv_heads = head_dim, num_heads, num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        per_rank_out = self.q_size + 2 * self.kv_size
        super().__init__(hidden_size, per_rank_out * tp, group, bias=bias, dtype=dtype, name="qkv")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        rank = self.group.rank
        heads = self.total_heads if shard_id == "q" else self.total_kv_heads
        expect_shape(loaded, heads * self.head_dim, *param.shape[1:])
        if shard_id == "q":
            offset, size, start = 0, self.q_size, rank * self.q_size
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, start = self.kv_size, (rank // self.kv_replicas) * self.kv_size
        param.data.narrow(0, offset, size).copy_(take(loaded, 0, start, size))


QKVParallelLinear.weight_loader.reads_slices = True


class RowParallelLinear(nn.Module):
    """y = sum over ``group`` of x[:, shard] @ W[:, shard].T; rows unchanged.

    With ``reduce_results=False`` it always returns this rank's partial sum (an attention
    output under a PARTIAL contract). Otherwise it reduces unless the open exit scope
    published ``fuse_mlp_allreduce`` or ``mlp_reduce_scatter``: then the boundary owns the sum.
    Inside a sequence-parallel exit it reduce-scatters onto the scattered rows instead, either
    way: the stage's output is complete there and the boundary owes nothing.
    The bias is added on group rank 0 only, so it survives any later sum exactly once.
    """

    packs_weight = True  # runtime/packed.py: a CPU weight packed once at load

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False,
                 reduce_results: bool = True, dtype=torch.float32, name: str = "linear"):
        super().__init__()
        flag("RowParallelLinear", "bias", bias)
        # "no" is truthy: it would reduce a partial the boundary owns
        self.group = group
        self.reduce_results = flag("RowParallelLinear", "reduce_results", reduce_results)
        self.lora = None  # adapters/lora.py attaches LoRA weights here
        self.packed = None  # runtime/packed.py: set by pack_linears after the load
        self.in_per_rank = _divide(in_features, group.size, f"{name} input size")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self._bias_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        expect_shape(loaded, param.shape[0], self.in_per_rank * self.group.size)
        n = self.in_per_rank  # the group reads the tensor together (shards.read_columns)
        read_columns(loaded, self.group, [(r * n, n) for r in range(self.group.size)],
                     param.data)

    def _bias_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        expect_shape(loaded, *param.shape)
        param.data.copy_(whole(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.group.rank == 0 else None
        y = linear(self, x, bias)
        if self.lora is not None:  # a partial of each row's adapter delta: summed with y's
            y = self.lora(x, y)
        scope = sequence_parallel_scope()
        if scope is not None:
            scope.check_group(self.group, type(self).__name__)
            return scope.scatter(y)
        if self.reduce_results and not get_forward().skips_reduction:
            y = all_reduce_rows(y, self.group)
        return y


RowParallelLinear.weight_loader.reads_slices = True
RowParallelLinear._bias_loader.reads_slices = True
