"""Fused checkpoint tensors (``runtime/fused.py``) at tp 1, 2 and 4, each rank's linear built
on a virtual group (no processes): its shard equals the slice cut from the unfused tensors,
from a plain tensor and from a safetensors slice (reading only the rows it keeps); a
tensor of another shape is an error naming it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from layer_boundary.models.loader import load_weights
from layer_boundary.runtime.fused import load_fused_blocks, load_per_head, use_loader
from layer_boundary.runtime.linear import ColumnParallelLinear, QKVParallelLinear
from layer_boundary.runtime.parallel import ParallelDims, virtual_parallel
from layer_boundary.runtime.shards import (CheckpointError, CheckpointSlice, ReadBytes,
                                           TensorFile)

HIDDEN, DIM, INTER = 6, 3, 8
TPS = [1, 2, 4]


def group(tp: int, rank: int):
    return virtual_parallel(ParallelDims(world_size=tp, tp=tp), rank).tp_group


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def rows(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s 1/tp of ``t``'s rows."""
    n = t.shape[0] // tp
    return t[rank * n:(rank + 1) * n]


def kv_rows(t: torch.Tensor, kv_heads: int, tp: int, rank: int) -> torch.Tensor:
    """A kv part's rows on ``rank``: split over tp, or the one head it replicates."""
    if tp >= kv_heads:
        head = rank // (tp // kv_heads)
        return t[head * DIM:(head + 1) * DIM]
    return rows(t, tp, rank)


def slices(tmp_path, tensors: dict, read: ReadBytes | None = None) -> dict:
    """Each tensor as the lazy loader hands it over: a ``CheckpointSlice`` of a file."""
    path = tmp_path / "fused.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    file = TensorFile(path)
    return {name: CheckpointSlice(name, file, read) for name in tensors}


def loaded(linear: nn.Module, tensors: dict) -> dict:
    """Each tensor loaded into the parameter of its name, through the parameter's loader."""
    out = {}
    for name, tensor in tensors.items():
        param = getattr(linear, name)
        param.weight_loader(param, tensor)
        out[name] = param.detach().clone()
    return out


# ------------------------------------------------------------------ blocks along dim 0


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_fused_qkv_blocks_give_each_rank_its_heads(tmp_path, tp, kv_heads):
    """Phi-3's qkv_proj [q; k; v]: each rank's q heads, its kv heads or the one it
    replicates, read from the file alone; the same as the linear's stacked q/k/v load."""
    heads = 4
    q, k, v = (randn(n * DIM, HIDDEN, seed=s) for s, n in enumerate((heads, kv_heads,
                                                                        kv_heads)))
    fused = torch.cat([q, k, v])
    for rank in range(tp):
        linear = QKVParallelLinear(HIDDEN, DIM, heads, kv_heads, group(tp, rank),
                                   dtype=torch.float64)
        stacked = linear.weight.detach().clone()
        for part, t in zip("qkv", (q, k, v)):
            linear.weight_loader(nn.Parameter(stacked, requires_grad=False), t, part)
        expected = torch.cat([rows(q, tp, rank), kv_rows(k, kv_heads, tp, rank),
                              kv_rows(v, kv_heads, tp, rank)])
        assert torch.equal(stacked, expected)
        use_loader(linear, load_fused_blocks(linear, (len(q), len(k), len(v)), "qkv"))
        assert torch.equal(loaded(linear, {"weight": fused})["weight"], expected)
        read = ReadBytes()
        got = loaded(linear, slices(tmp_path, {"weight": fused}, read))["weight"]
        assert torch.equal(got, expected)
        assert read.bytes == expected.numel() * expected.element_size()  # its rows alone


@pytest.mark.parametrize("tp", TPS)
def test_fused_gate_up_gives_each_rank_its_gate_then_its_up(tmp_path, tp):
    """Phi-3's gate_up_proj [gate; up] into one column-parallel linear: on each rank its
    gate rows then its up rows, so ``chunk(2)`` of its output is its gate and up."""
    gate, up, x = randn(INTER, HIDDEN, seed=1), randn(INTER, HIDDEN, seed=2), randn(5, HIDDEN)
    fused = torch.cat([gate, up])
    for rank in range(tp):
        linear = ColumnParallelLinear(HIDDEN, 2 * INTER, group(tp, rank), bias=True,
                                      dtype=torch.float64)
        use_loader(linear, load_fused_blocks(linear, (INTER, INTER), (0, 1)))
        bias = randn(2 * INTER, seed=3)
        read = ReadBytes()
        got = loaded(linear, slices(tmp_path, {"weight": fused, "bias": bias}, read))
        assert torch.equal(got["weight"], torch.cat([rows(gate, tp, rank), rows(up, tp, rank)]))
        assert torch.equal(got["bias"], torch.cat([rows(bias[:INTER], tp, rank),
                                                   rows(bias[INTER:], tp, rank)]))
        assert read.bytes == sum(t.numel() * t.element_size() for t in got.values())
        g, u = linear(x).chunk(2, dim=-1)
        torch.testing.assert_close(g, x @ rows(gate, tp, rank).T + rows(bias[:INTER], tp, rank))
        torch.testing.assert_close(u, x @ rows(up, tp, rank).T + rows(bias[INTER:], tp, rank))


def test_blocks_on_disk_in_another_order_land_in_their_slots():
    """shard_ids place each block: [up; gate] on disk into a linear laid out gate, up."""
    gate, up = randn(INTER, HIDDEN, seed=1), randn(INTER, HIDDEN, seed=2)
    linear = ColumnParallelLinear(HIDDEN, 2 * INTER, group(2, 1), dtype=torch.float64)
    use_loader(linear, load_fused_blocks(linear, (INTER, INTER), (1, 0)))
    got = loaded(linear, {"weight": torch.cat([up, gate])})["weight"]
    assert torch.equal(got, torch.cat([rows(gate, 2, 1), rows(up, 2, 1)]))


# ------------------------------------------------------------------ per-head interleaved


@pytest.mark.parametrize("tp", TPS)
def test_per_head_qkv_gives_each_rank_its_heads(tmp_path, tp):
    """GPT-NeoX's query_key_value [heads, (q, k, v), head_dim] (weight and bias): each rank
    its heads' q, k and v rows, one contiguous run of the file read."""
    heads = 4
    q, k, v = (randn(heads * DIM, HIDDEN, seed=s) for s in range(3))
    qb, kb, vb = (randn(heads * DIM, seed=s) for s in range(3, 6))
    # [heads, 3, D, ...] flattened: head 0's q, k, v rows, then head 1's ...
    fused = torch.stack([t.view(heads, DIM, HIDDEN) for t in (q, k, v)], 1).reshape(-1, HIDDEN)
    fused_bias = torch.stack([t.view(heads, DIM) for t in (qb, kb, vb)], 1).reshape(-1)
    for rank in range(tp):
        linear = QKVParallelLinear(HIDDEN, DIM, heads, heads, group(tp, rank), bias=True,
                                   dtype=torch.float64)
        use_loader(linear, load_per_head(linear))
        read = ReadBytes()
        got = loaded(linear, slices(tmp_path, {"weight": fused, "bias": fused_bias}, read))
        assert torch.equal(got["weight"], torch.cat([rows(t, tp, rank) for t in (q, k, v)]))
        assert torch.equal(got["bias"], torch.cat([rows(t, tp, rank) for t in (qb, kb, vb)]))
        assert read.bytes == sum(t.numel() * t.element_size() for t in got.values())
        plain = loaded(linear, {"weight": fused, "bias": fused_bias})
        assert all(torch.equal(plain[n], got[n]) for n in got)


# ------------------------------------------------------------------ refusals


def test_a_fused_tensor_of_another_shape_is_an_error_naming_it(tmp_path):
    linear = QKVParallelLinear(HIDDEN, DIM, 4, 2, group(2, 0), dtype=torch.float64)
    use_loader(linear, load_fused_blocks(linear, (4 * DIM, 2 * DIM, 2 * DIM), "qkv",
                                         name="layers.0.qkv_proj"))
    short = randn(7 * DIM, HIDDEN)  # a kv head short
    with pytest.raises(ValueError, match=r"layers.0.qkv_proj has shape \(21, 6\); the fused "
                                         r"layout \(blocks 12 q \+ 6 k \+ 6 v\) is \(24, 6\)"):
        linear.weight.weight_loader(linear.weight, short)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    with pytest.raises(CheckpointError, match=f"checkpoint tensor {name} has shape"):
        linear.weight.weight_loader(linear.weight, slices(tmp_path, {name: short})[name])
    heads = QKVParallelLinear(HIDDEN, DIM, 4, 4, group(2, 0), bias=True, dtype=torch.float64)
    use_loader(heads, load_per_head(heads, name="query_key_value"))
    with pytest.raises(ValueError, match=r"query_key_value has shape \(12,\)"):
        heads.bias.weight_loader(heads.bias, randn(4 * DIM))  # q's bias alone


def test_load_weights_names_the_checkpoint_tensor(tmp_path):
    """Through the model loader, a mismatched fused tensor is a CheckpointError naming it."""
    module = nn.Module()
    module.gate_up_proj = ColumnParallelLinear(HIDDEN, 2 * INTER, group(2, 0),
                                               dtype=torch.float64)
    use_loader(module.gate_up_proj, load_fused_blocks(module.gate_up_proj, (INTER, INTER),
                                                      (0, 1)))
    name = "gate_up_proj.weight"
    tensors = slices(tmp_path, {name: randn(INTER, HIDDEN)})  # the gate alone
    with pytest.raises(CheckpointError, match=f"checkpoint tensor {name} has shape"):
        load_weights(module, tensors.items())
    with pytest.raises(CheckpointError, match=f"checkpoint tensor {name} "):
        load_weights(module, [(name, randn(INTER, HIDDEN))])


@pytest.mark.parametrize("build,message", [
    (lambda g: load_fused_blocks(QKVParallelLinear(HIDDEN, DIM, 4, 2, g), (12, 6, 6), "qkq"),
     "must be q, k and v, each once"),
    (lambda g: load_fused_blocks(QKVParallelLinear(HIDDEN, DIM, 4, 2, g), (12, 3, 9), "qkv"),
     "block k has 3 rows; the linear's k has 6"),
    (lambda g: load_fused_blocks(ColumnParallelLinear(HIDDEN, 16, g), (8, 4), (0, 1)),
     "blocks of 12 rows in all; the linear has 16"),
    (lambda g: load_fused_blocks(ColumnParallelLinear(HIDDEN, 16, g), (6, 10), (0, 1)),
     "a block of 6 rows is not divisible by the tensor-parallel size 4"),
    (lambda g: load_fused_blocks(ColumnParallelLinear(HIDDEN, 16, g), (8, 8), (0, 0)),
     "must be the slots 0..1, each once"),
    (lambda g: load_per_head(QKVParallelLinear(HIDDEN, DIM, 4, 2, g)),
     "4 heads and 2 kv heads"),
    (lambda g: load_per_head(QKVParallelLinear(HIDDEN, DIM, 4, 4, g), parts=2), "parts=2"),
])
def test_blocks_that_do_not_fit_the_linear_are_refused_before_a_load(build, message):
    with pytest.raises(ValueError, match=message):
        build(group(4, 0))
