"""transformers' modules on the meta device, made ours: each linear the tp_plan names swapped
for our parallel linear of its style, every other parameter allocated on this rank's device
(and read from the checkpoint by its own name)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ...runtime.linear import (ColumnParallelLinear, RowParallelLinear, expect_shape,
                               head_split)
from ...runtime.shards import take
from .config import (COLWISE, COLWISE_GATHER, MOE_EXPERTS, REPLICATED, ROWWISE,
                     ROWWISE_SPLIT, refuse)


class HeadColumnLinear(ColumnParallelLinear):
    """A column-parallel projection onto attention heads, ``unit`` outputs each (head_dim; 1
    for a gate per head): heads split over ``group``, or, where the group is larger than the
    head count, each head replicated on ``group.size // heads`` consecutive ranks (as
    ``QKVParallelLinear``'s kv heads)."""

    def __init__(self, in_features: int, out_features: int, unit: int, group, *, bias: bool,
                 dtype, name: str) -> None:
        local, self.replicas = head_split(out_features // unit, group.size, f"{name} heads")
        self.full = out_features
        super().__init__(in_features, local * unit * group.size, group, bias=bias, dtype=dtype,
                         name=name)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        expect_shape(loaded, self.full, *param.shape[1:])
        start = (self.group.rank // self.replicas) * self.out_per_rank
        param.data.copy_(take(loaded, 0, start, self.out_per_rank))


HeadColumnLinear.weight_loader.reads_slices = True


class SplitInputRowLinear(RowParallelLinear):
    """A row-parallel linear over a whole input (``rowwise_split_input``): each rank takes its
    slice of the features (the gathered output of ``colwise_gather_output`` projections)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.in_per_rank
        return super().forward(x.narrow(-1, self.group.rank * n, n))


def _head_unit(linear: nn.Linear, cfg, name: str) -> int:
    """The outputs of one head of an attention projection: head_dim, or one (a gate per
    head)."""
    out = linear.out_features
    if out % cfg.head_dim == 0:
        return cfg.head_dim
    if out % cfg.num_attention_heads == 0:
        return out // cfg.num_attention_heads
    raise ValueError(f"{name}'s {out} outputs are no whole number of heads of {cfg.head_dim}")


def parallel_linear(linear: nn.Linear, style: str | None, name: str, *, attention: bool,
                    runtime, cfg, dtype) -> nn.Module:
    """Our linear for transformers' ``linear`` (on the meta device) of tp_plan ``style``:
    colwise splits the output (heads of the attention), rowwise the input (an attention's sum
    owed to the boundary; an FFN's obeying the exit's flags), ``colwise_gather_output`` and
    ``rowwise_split_input`` the same with the heads gathered between; unplanned or
    replicated, a whole copy on every rank, refused where its output would join a stage's sum
    over ranks (an output of the hidden size)."""
    group = runtime.parallel.attn_tp_group if attention else runtime.parallel.tp_group
    bias = linear.bias is not None
    short = name.rsplit(".", 1)[-1]
    shape = (linear.in_features, linear.out_features, group)
    if style == COLWISE and attention:
        return HeadColumnLinear(linear.in_features, linear.out_features,
                                _head_unit(linear, cfg, name), group, bias=bias, dtype=dtype,
                                name=short)
    if style in (COLWISE, COLWISE_GATHER):
        return ColumnParallelLinear(*shape, bias=bias, gather_output=style == COLWISE_GATHER,
                                    dtype=dtype, name=short)
    if style in (ROWWISE, ROWWISE_SPLIT):
        cls = SplitInputRowLinear if style == ROWWISE_SPLIT else RowParallelLinear
        return cls(*shape, bias=bias, reduce_results=not attention, dtype=dtype, name=short)
    if style is None or style in REPLICATED:
        if group.size > 1 and linear.out_features == cfg.hidden_size:
            raise ValueError(f"{name} is in no tp_plan entry and writes the hidden size: a "
                             "whole copy on every rank would join the stage's sum over "
                             f"{group.size} ranks once per rank")
        out = nn.Linear(linear.in_features, linear.out_features, bias=bias, dtype=dtype)
        for p in out.parameters():
            p.requires_grad_(False)
        return out
    raise ValueError(f"{name}: tp_plan style {style!r} is not served (colwise, rowwise and "
                     "replicated linears only)")


def make_ours(layer: nn.Module, prefix: str, cfg, runtime, dtype) -> None:
    """Swap each ``nn.Linear`` of transformers' ``layer`` (built on the meta device; its name
    in the base model ``prefix``) for ours, then allocate every other parameter on the default
    device in ``dtype``. A buffer transformers computed at construction cannot be rebuilt from
    the meta device: refused by name."""
    model_type = cfg.model_type
    moe_blocks = set()  # the stage modules (``mlp``) holding stacked experts
    for name, module in list(layer.named_modules()):
        full = f"{prefix}.{name}"
        style = cfg.style(full) if name else None
        if style == MOE_EXPERTS:
            from .moe import make_experts_ours

            make_experts_ours(module, full, cfg, runtime, dtype)
            moe_blocks.add(name.split(".")[0])
            continue
        if type(module) is not nn.Linear:  # a subclass (a router) keeps its own forward
            continue
        try:
            ours = parallel_linear(module, style, full,
                                   attention=name.split(".")[0] == "self_attn", runtime=runtime,
                                   cfg=cfg, dtype=dtype)
        except ValueError as exc:
            raise refuse(model_type, str(exc)) from None
        parent, _, leaf = name.rpartition(".")
        setattr(layer.get_submodule(parent) if parent else layer, leaf, ours)
    for block in moe_blocks:  # its partials summed once (experts, shared expert)
        from .moe import owe_one_sum

        owe_one_sum(layer.get_submodule(block), runtime.parallel.tp_group)
    for path, module in layer.named_modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if not buffer.is_meta:
                continue
            if name in module._non_persistent_buffers_set:
                raise refuse(model_type, f"{prefix}.{path}.{name} is a buffer transformers "
                             "computes at construction, which the generic path cannot rebuild")
            # a buffer the checkpoint holds (a router's score bias): loaded as a parameter
            del module._buffers[name]
            module.register_parameter(name, nn.Parameter(torch.empty(buffer.shape,
                                                                     dtype=buffer.dtype),
                                                         requires_grad=False))
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta:
                continue
            if path == "self_attn" and runtime is not None:
                param = head_param(param, f"{prefix}.{path}.{name}", cfg,
                                   runtime.parallel.attn_tp_group, dtype)
            else:
                param = nn.Parameter(torch.empty(param.shape, dtype=dtype), requires_grad=False)
            setattr(module, name, param)


def head_param(param, name: str, cfg, group, dtype) -> nn.Parameter:
    """A parameter of the attention module itself (not of a linear or norm inside it), on this
    rank: one row per query head (GPT-OSS-style sinks) split over attention TP as the heads
    are, anything else whole."""
    heads = cfg.num_attention_heads
    if param.dim() == 0 or param.shape[0] != heads or group.size == 1:
        return nn.Parameter(torch.empty(param.shape, dtype=dtype), requires_grad=False)
    if heads % group.size:
        raise refuse(cfg.model_type, f"{name} holds one row per head, and its {heads} heads do "
                     f"not split over attention TP {group.size}")
    rows = heads // group.size
    local = nn.Parameter(torch.empty((rows, *param.shape[1:]), dtype=dtype),
                         requires_grad=False)

    def loader(target, loaded):
        expect_shape(loaded, *param.shape)
        target.data.copy_(take(loaded, 0, group.rank * rows, rows))

    loader.reads_slices = True
    local.weight_loader = loader
    return local


def rotary(model, hf, device):
    """transformers' rotary module of ``model`` (a skeleton; None: it has none), built for
    real from config ``hf`` on ``device`` (its tables are computed at construction)."""
    module = getattr(model.model, "rotary_emb", None)
    if module is None:
        return None
    try:
        with torch.device(device):
            return type(module)(config=hf)
    except TypeError as exc:
        raise refuse(hf.model_type, f"its rotary module {type(module).__name__} is not built "
                     f"from the config alone ({exc})") from None


_SAME_NORM: dict = {}  # (transformers' class, ours) -> whether they compute the same


def _candidates(norm) -> list:
    from ...runtime.norm import Fp32ScaleRMSNorm, GemmaRMSNorm, LayerNorm, RMSNorm

    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    weight = getattr(norm, "weight", None)
    if not isinstance(eps, float) or weight is None or weight.dim() != 1:
        return []
    size, bias = weight.shape[0], getattr(norm, "bias", None)
    if isinstance(bias, torch.Tensor):
        return [lambda dtype: LayerNorm(size, eps, bias=True, dtype=dtype)]
    return [lambda dtype, cls=cls: cls(size, eps, dtype=dtype)
            for cls in (RMSNorm, GemmaRMSNorm, Fp32ScaleRMSNorm)] + [
        lambda dtype: LayerNorm(size, eps, bias=False, dtype=dtype)]


def _same(norm, ours) -> bool:
    """Whether transformers' ``norm`` (meta) and ``ours`` give the same numbers: both with
    the same random weights, on random fp32 and bf16 rows (bf16 to the bit)."""
    key = (type(norm), type(ours), getattr(ours, "bias", None) is not None)
    if key not in _SAME_NORM:
        # on the CPU whatever the default device (a rank's size check builds on meta)
        with torch.device("cpu"):
            theirs = copy.deepcopy(norm).to_empty(device="cpu").float()
            mine = copy.deepcopy(ours).to_empty(device="cpu").float()
            generator = torch.Generator().manual_seed(0)
            same = True
            with torch.no_grad():
                for (_, a), (_, b) in zip(sorted(theirs.named_parameters()),
                                          sorted(mine.named_parameters())):
                    a.copy_(torch.randn(a.shape, generator=generator) * 0.3 + 0.5)
                    b.copy_(a)
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(5, theirs.weight.shape[0], generator=generator).to(dtype)
                    try:
                        want = theirs.to(dtype)(x) if dtype is torch.float32 else theirs(x)
                    except Exception:  # noqa: BLE001 - a norm that does not run alone stays theirs
                        same = False
                        break
                    got = mine(x)
                    same = same and got.dtype == want.dtype and (
                        torch.allclose(got, want, rtol=1e-6, atol=1e-6)
                        if dtype is torch.float32 else torch.equal(got, want))
            _SAME_NORM[key] = same
    return _SAME_NORM[key]


def our_norm(norm: nn.Module, dtype) -> nn.Module:
    """Our norm for transformers' ``norm`` (on the meta device) where one computes the same
    (the boundary then reads it through the fused add+norm), else ``norm`` itself,
    materialized."""
    for make in _candidates(norm):
        with torch.device("meta"):
            probe = make(torch.float32)
        if _same(norm, probe):
            return make(dtype)
    return norm
