"""Checkpoint tensors that fuse several projections into one, loaded into the library's
merged linears, each rank reading only its rows.

Phi-3 stores q, k and v as one ``qkv_proj.weight`` [q + 2 * kv, hidden] and its MLP's gate
and up as one ``gate_up_proj.weight`` [2 * intermediate, hidden]: blocks concatenated along
dim 0 (``load_fused_blocks``). GPT-NeoX stores ``attention.query_key_value`` heads-major,
[heads, (q, k, v), head_dim] flattened to dim 0 (``load_per_head``).

What a loader receives: ``models/loader.load_weights`` hands a parameter's ``weight_loader``
the checkpoint tensor filed under the parameter's name, always the whole, unsharded tensor:
a ``CheckpointSlice`` (its shape and dtype from the safetensors header, its rows read on
demand; ``shards.py``) where the loader declares ``reads_slices``, as these do, else a plain
tensor already cast to the parameter's dtype (``iter_weights(lazy=False)``, a test). The
loaders here check the full shape first, then read with ``shards.take`` only the rows this
rank keeps: one contiguous run of rows per block, or one run for all of a rank's interleaved
heads.

A loader is installed with ``use_loader(linear, loader)``: on the linear's weight and bias,
and on the linear itself, so what loads through ``linear.weight_loader`` (a LoRA adapter's B,
``adapters/lora.py``) cuts its rows the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from .linear import ColumnParallelLinear, QKVParallelLinear
from .shards import CheckpointError, CheckpointSlice, take

QKV = ("q", "k", "v")


@dataclass(frozen=True)
class Cut:
    """Rows [source, source + length) of the fused tensor go to rows [offset, offset +
    length) of this rank's parameter."""

    source: int
    length: int
    offset: int


def load_fused_blocks(linear: ColumnParallelLinear, sizes: Sequence[int],
                      shard_ids: Sequence, name: str | None = None) -> Callable:
    """A ``weight_loader`` for a checkpoint tensor of blocks concatenated along dim 0.

    Block i holds ``sizes[i]`` rows; ``shard_ids[i]`` says where it goes in ``linear``:

    - a ``QKVParallelLinear``: "q", "k" or "v", each once. Each block is cut as the linear's
      own loader cuts that part: this rank's query heads; its kv heads, or the one kv head it
      replicates where the group outnumbers the kv heads.
    - a plain ``ColumnParallelLinear`` (a merged one, Phi-3's ``gate_up_proj``): the block's
      slot, 0 .. n-1, each once. On every rank the linear's rows are its slots in order, each
      this rank's 1/tp of its block's rows (gate shard then up shard).

    The loader takes ``(param, loaded)`` for the weight [sum(sizes), in] or the bias
    [sum(sizes)] and reads only this rank's rows of each block. A tensor of another shape
    raises an error naming it (``CheckpointError`` for a checkpoint slice, else a
    ``ValueError`` naming ``name``); sizes that do not fit the linear raise ``ValueError``
    here, before any load.
    """
    label = name or f"fused tensor of {type(linear).__name__}"
    sizes, shard_ids = tuple(sizes), tuple(shard_ids)
    if len(sizes) != len(shard_ids) or not sizes:
        raise ValueError(f"{label}: {len(sizes)} block sizes for {len(shard_ids)} shard ids")
    if isinstance(linear, QKVParallelLinear):
        cuts = _qkv_cuts(linear, sizes, shard_ids, label)
    else:
        cuts = _column_cuts(linear, sizes, shard_ids, label)
    total = sum(sizes)
    what = " + ".join(f"{s} {i}" for s, i in zip(sizes, shard_ids))

    def loader(param: nn.Parameter, loaded) -> None:
        _expect_rows(loaded, (total, *param.shape[1:]), label, f"blocks {what}")
        for cut in cuts:
            param.data.narrow(0, cut.offset, cut.length).copy_(
                take(loaded, 0, cut.source, cut.length))

    loader.reads_slices = True
    return loader


def _qkv_cuts(linear: QKVParallelLinear, sizes, shard_ids, label: str) -> list[Cut]:
    if sorted(shard_ids) != sorted(QKV):
        raise ValueError(f"{label}: shard ids {list(shard_ids)} must be q, k and v, each once")
    rank, q, kv = linear.group.rank, linear.q_size, linear.kv_size
    kv_start = (rank // linear.kv_replicas) * kv  # a replicated kv head: its group's one
    # part: (its full rows, this rank's first row in the block, rows kept, offset in param),
    # as the linear's own loader cuts it
    place = {"q": (linear.total_heads * linear.head_dim, rank * q, q, 0),
             "k": (linear.total_kv_heads * linear.head_dim, kv_start, kv, q),
             "v": (linear.total_kv_heads * linear.head_dim, kv_start, kv, q + kv)}
    cuts, source = [], 0
    for size, part in zip(sizes, shard_ids):
        full, start, length, offset = place[part]
        if size != full:
            raise ValueError(f"{label}: block {part} has {size} rows; the linear's {part} has "
                             f"{full}")
        cuts.append(Cut(source + start, length, offset))
        source += size
    return cuts


def _column_cuts(linear: ColumnParallelLinear, sizes, shard_ids, label: str) -> list[Cut]:
    if not isinstance(linear, ColumnParallelLinear):
        raise ValueError(f"{label}: {type(linear).__name__} is not a column-parallel linear")
    if sorted(shard_ids) != list(range(len(sizes))):
        raise ValueError(f"{label}: shard ids {list(shard_ids)} must be the slots "
                         f"0..{len(sizes) - 1}, each once")
    tp, rank = linear.group.size, linear.group.rank
    if sum(sizes) != linear.out_per_rank * tp:
        raise ValueError(f"{label}: blocks of {sum(sizes)} rows in all; the linear has "
                         f"{linear.out_per_rank * tp}")
    for size in sizes:
        if size % tp:
            raise ValueError(f"{label}: a block of {size} rows is not divisible by the "
                             f"tensor-parallel size {tp}")
    per_rank = {slot: size // tp for size, slot in zip(sizes, shard_ids)}
    cuts, source = [], 0
    for size, slot in zip(sizes, shard_ids):
        offset = sum(per_rank[s] for s in range(slot))  # the slots before it, this rank's rows
        cuts.append(Cut(source + rank * per_rank[slot], per_rank[slot], offset))
        source += size
    return cuts


def load_per_head(linear: QKVParallelLinear, parts: int = 3, name: str | None = None
                  ) -> Callable:
    """A ``weight_loader`` for q/k/v interleaved per head (GPT-NeoX's ``query_key_value``):
    the weight [heads * 3 * head_dim, in] or bias [heads * 3 * head_dim] laid out as
    [heads, (q, k, v), head_dim], heads-major, into a ``QKVParallelLinear`` with as many kv
    heads as heads (multi-head attention) and ``parts`` 3.

    A rank's heads are consecutive, so their rows are one contiguous run of the fused tensor:
    the loader reads that run alone and regroups it into the linear's [q; k; v] rows. A
    tensor of another shape raises an error naming it, as ``load_fused_blocks``'s does.
    """
    label = name or f"per-head fused tensor of {type(linear).__name__}"
    if not isinstance(linear, QKVParallelLinear):
        raise ValueError(f"{label}: {type(linear).__name__} is not a QKVParallelLinear")
    if parts != len(QKV):
        raise ValueError(f"{label}: parts={parts}; a q/k/v projection has 3 per head")
    if linear.total_kv_heads != linear.total_heads:
        raise ValueError(f"{label}: {linear.total_heads} heads and {linear.total_kv_heads} kv "
                         "heads; heads-major q/k/v needs as many kv heads as heads")
    heads, dim = linear.num_heads, linear.head_dim  # this rank's heads
    rows = heads * parts * dim
    start = linear.group.rank * rows

    def loader(param: nn.Parameter, loaded) -> None:
        total = linear.total_heads * parts * dim
        _expect_rows(loaded, (total, *param.shape[1:]), label,
                     f"{linear.total_heads} heads x (q, k, v) x {dim}")
        block = take(loaded, 0, start, rows)
        rest = block.shape[1:]
        # [heads * 3 * D, ...] -> [heads, 3, D, ...] -> [3, heads, D, ...]: q rows, k, v
        block = block.reshape(heads, parts, dim, *rest).transpose(0, 1)
        param.data.copy_(block.reshape(rows, *rest))

    loader.reads_slices = True
    return loader


def use_loader(linear: nn.Module, loader: Callable) -> None:
    """Load ``linear``'s weight and bias (if any) with ``loader``, and make it the linear's
    own ``weight_loader`` (what loads other tensors shaped like its weight, such as a LoRA
    adapter's B, then cuts them the same way)."""
    linear.weight.weight_loader = loader
    if getattr(linear, "bias", None) is not None:
        linear.bias.weight_loader = loader
    linear.weight_loader = loader


def _expect_rows(loaded, shape: tuple, label: str, layout: str) -> None:
    if tuple(loaded.shape) == tuple(shape):
        return
    got = tuple(loaded.shape)
    if isinstance(loaded, CheckpointSlice):
        raise CheckpointError(f"checkpoint tensor {loaded.name} has shape {got}; the fused "
                              f"layout ({layout}) is {tuple(shape)}")
    raise ValueError(f"{label} has shape {got}; the fused layout ({layout}) is {tuple(shape)}")


__all__ = ["Cut", "load_fused_blocks", "load_per_head", "use_loader"]
