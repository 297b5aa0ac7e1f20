"""Linear weights laid out once for the CPU's kernels (runtime/packed.py): a wide weight stored
transposed in place, and a packed copy for oneDNN; the packed matmul is the one that runs
where it applies, matches ``F.linear`` on every row count, and steps aside wherever its copy
could be stale or does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed.pool import get_pool
from layer_boundary.runtime import packed as packing
from layer_boundary.runtime.embedding import ParallelLMHead
from layer_boundary.runtime.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from layer_boundary.runtime.parallel import ParallelDims, build_parallel

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="torch without oneDNN packs nothing")
PACKED_OP = "mkldnn::_linear_pointwise"


def _ops(call) -> tuple[torch.Tensor, list[str]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = call()
    return out, [e.name for e in prof.events()]


def _column(out=48, inp=32, bias=True, dtype=torch.float32, seed=0):
    group = build_parallel(ParallelDims(world_size=1, tp=1)).tp_group
    layer = ColumnParallelLinear(inp, out, group, bias=bias, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_((torch.randn(out, inp, generator=g) * inp ** -0.5).to(dtype))
        if bias:
            layer.bias.copy_(torch.randn(out, generator=g).to(dtype))
    return layer


@pytest.mark.parametrize("rows", [0, 1, 3, 16, 100])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", [(512, 32), (512, 512), (64, 512)],
                         ids=["wide", "square", "narrow"])
def test_packed_matmul_runs_and_matches(rows, bias, shape):
    layer = _column(out=shape[0], inp=shape[1], bias=bias)
    assert packing.pack_linears(layer, min_elements=0) == 1
    # a wide weight is stored [in, out] row-major, its [out, in] shape kept
    wide = shape[0] > shape[1]
    assert layer.weight.shape == shape and layer.weight.is_contiguous() != wide
    x = torch.randn(rows, shape[1])
    y, ops = _ops(lambda: layer(x))
    # several rows run on the packed copy; one row is a matrix-vector product, through MKL
    packed = rows != 1
    assert ops.count(PACKED_OP) == packed and ("aten::linear" in ops) != packed
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_a_wide_weight_is_stored_transposed_in_place():
    head = ParallelLMHead(96, 16, build_parallel(ParallelDims(world_size=1, tp=1)).tp_group)
    embedding = nn.Embedding(96, 16)
    head.weight.data.copy_(torch.randn(96, 16))
    embedding.weight = head.weight  # tied: one parameter, held by a module that packs nothing
    before, param = head.weight.detach().clone(), head.weight
    ids = torch.tensor([[3, 95, 0]])
    looked_up = embedding(ids)
    assert packing.pack_linears(nn.ModuleList([head, embedding])) == 0  # under PACK_MIN
    assert head.weight is param and embedding.weight is param and not param.requires_grad
    assert param.shape == (96, 16) and param.stride() == (1, 96)
    assert torch.equal(param, before) and torch.equal(embedding(ids), looked_up)
    ptr = param.data_ptr()
    packing.pack_linears(head)  # again: already laid out, left as it is
    assert param.data_ptr() == ptr and param.stride() == (1, 96)
    x = torch.randn(1, 16)
    torch.testing.assert_close(head(x), x @ before.t(), rtol=1e-5, atol=1e-5)
    # where the storage stays: not wide, not float32/bfloat16, not on the CPU, inference
    assert not packing.stores_transposed(torch.zeros(16, 16))
    assert not packing.stores_transposed(torch.zeros(16, 96))
    assert not packing.stores_transposed(torch.zeros(96, 16, dtype=torch.float64))
    assert not packing.stores_transposed(torch.zeros(96, 16, device="meta"))
    assert not packing.stores_transposed(torch.zeros(96, 16).t().contiguous().t())
    with torch.inference_mode():
        frozen = torch.zeros(96, 16)
    assert not packing.stores_transposed(frozen)
    assert packing.stores_transposed(torch.zeros(96, 16, dtype=torch.bfloat16))


def test_packed_matmul_bf16_and_3d_inputs():
    layer = _column(dtype=torch.bfloat16)
    packing.pack_linears(layer, min_elements=0)
    x = torch.randn(2, 5, 32).bfloat16()
    y, ops = _ops(lambda: layer(x))
    assert PACKED_OP in ops and y.shape == (2, 5, 48)
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-2, atol=1e-2)
    strided = torch.randn(7, 64)[:, :32]  # a view: rows not contiguous
    torch.testing.assert_close(layer(strided.bfloat16()),
                               F.linear(strided.bfloat16(), layer.weight, layer.bias),
                               rtol=1e-2, atol=1e-2)


def test_a_weight_changed_after_packing_is_never_read_stale():
    layer = _column()
    packing.pack_linears(layer, min_elements=0)
    x = torch.randn(4, 32)
    with torch.no_grad():
        layer.weight.mul_(2)  # in place: the version counter moves
    y, ops = _ops(lambda: layer(x))
    assert PACKED_OP not in ops
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))
    layer.weight.data = torch.randn(48, 32)  # reassigned: another storage
    y, ops = _ops(lambda: layer(x))
    assert PACKED_OP not in ops
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))
    packing.pack_linears(layer, min_elements=0)  # packed again: the new weight's copy runs
    y, ops = _ops(lambda: layer(x))
    assert PACKED_OP in ops
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_where_the_packed_copy_does_not_apply(monkeypatch):
    layer = _column()
    packing.pack_linears(layer, min_elements=0)
    x = torch.randn(4, 32)
    packed_calls = []
    matmul = packing._matmul
    monkeypatch.setattr(packing, "_matmul", lambda *a: packed_calls.append(1) or matmul(*a))
    # another dtype: F.linear's own error names it
    with pytest.raises(RuntimeError, match="dtype"):
        layer(x.double())
    y = layer(x.clone().requires_grad_())  # autograd: F.linear, a graph to differentiate
    assert y.requires_grad and packed_calls == []
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    y = compiled(x)  # a compiled graph runs F.linear on the weight
    assert packed_calls == []
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))
    layer(x)  # and eager inference runs the packed copy (the counter counts)
    assert packed_calls == [1]


def test_what_gets_a_packed_copy():
    assert packing.pack(torch.empty(4, 4, device="meta"), 0) is None
    assert packing.pack(torch.zeros(4, 4, dtype=torch.float64), 0) is None
    assert packing.pack(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), 0) is None
    assert packing.pack(torch.zeros(0, 4), 0) is None
    with torch.inference_mode():  # no version counter: a write could not be told apart
        frozen = torch.zeros(4, 4)
    assert packing.pack(frozen, 0) is None
    assert packing.pack(torch.zeros(4, 4, dtype=torch.bfloat16), min_elements=0) is not None
    small = torch.zeros(256, 256)  # oneDNN's per-call work is MKL's whole product here
    assert packing.pack(small) is None and packing.pack(torch.zeros(257, 256)) is not None
    # declared on the classes, not found by type: the stack's linears and the LM head
    declared = {cls for cls in (ColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                ParallelLMHead) if cls.packs_weight}
    assert len(declared) == 4
    assert not getattr(nn.Linear, "packs_weight", False)
    model = nn.Sequential(_column(), nn.Linear(32, 32))
    assert packing.pack_linears(model, min_elements=0) == 1 and not hasattr(model[1], "packed")


def _tp_packed(weight, bias, x, wide):
    tp = dist.get_world_size()
    group = build_parallel(ParallelDims(world_size=tp, tp=tp)).tp_group
    col = ColumnParallelLinear(weight.shape[1], weight.shape[0], group, bias=True,
                               gather_output=True)
    row = RowParallelLinear(weight.shape[0], weight.shape[1], group, bias=True)
    col.weight.weight_loader(col.weight, weight)
    col.bias.weight_loader(col.bias, bias)
    row.weight.weight_loader(row.weight, weight.t().contiguous())
    row.bias.weight_loader(row.bias, bias[: weight.shape[1]])
    assert packing.pack_linears(nn.ModuleList([col, row]), min_elements=0) == 2
    shard = wide.shape[1] // tp  # a row-parallel linear takes its rank's input features
    local = wide[:, group.rank * shard:(group.rank + 1) * shard]
    (a, b), ops = _ops(lambda: (col(x), row(local)))
    return ops.count(PACKED_OP), a, b


@pytest.mark.parametrize("tp", [2])
def test_packed_tensor_parallel_linears_match_dense(tp):
    g = torch.Generator().manual_seed(3)
    weight, bias, x, wide = (torch.randn(64, 32, generator=g), torch.randn(64, generator=g),
                             torch.randn(5, 32, generator=g), torch.randn(5, 64, generator=g))
    for count, a, b in get_pool(tp).run(_tp_packed, weight, bias, x, wide):
        assert count == 2
        torch.testing.assert_close(a, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b, F.linear(wide, weight.t(), bias[:32]),
                                   rtol=1e-5, atol=1e-5)


def test_the_memory_estimate_counts_the_packed_copies():
    from layer_boundary.models.estimate import MemoryEstimate

    group = build_parallel(ParallelDims(world_size=1, tp=1)).tp_group
    with torch.device("meta"):  # as the estimate builds its models: nothing allocated
        model = nn.ModuleList([ColumnParallelLinear(512, 512, group),  # over PACK_MIN
                               RowParallelLinear(16, 16, group),  # under it: not packed
                               ColumnParallelLinear(512, 512, group, dtype=torch.float64)])
    assert packing.packed_bytes(model) == 512 * 512 * 4
    estimate = MemoryEstimate(parameters=10, kv_cache=1, activations=1, processes=2,
                              packed=512 * 512 * 4)
    assert estimate.per_rank == 12 + 512 * 512 * 4
    assert "their packed copies 1.00 MB" in estimate.describe()
    assert estimate.as_dict()["packed"] == 512 * 512 * 4
