"""MoE blocks on the Transformers backend: transformers' stacked experts (``moe_tp_experts``
in the tp_plan) with their intermediate split over TP, their output's sum owed to the
boundary.

transformers 5 holds a block's routed experts as one module (``use_experts_implementation``)
with stacked parameters: ``gate_up_proj`` [experts, 2 * inter, hidden] (each expert's gate
rows, then its up rows; ``up_proj`` [experts, inter, hidden] where ungated) and ``down_proj``
[experts, hidden, inter]. Each rank keeps the experts of its EP rank (``moe_ep``; one EP rank
unless asked) and its moe_tp slice of every expert's intermediate: the gate half's and the up
half's rows, the down projection's columns. transformers' own forward of the module then
computes this rank's partial sum over the TP group, which the block adds to its other partials
(a shared expert's); the block's output is left to the boundary where the exit skips the
reduction, all-reduced once on the spot otherwise (``owe_one_sum``).

The checkpoint holds what ``save_pretrained`` writes: one matrix per expert and projection
(``mlp.experts.3.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.3.w1.weight``),
which transformers stacks on load by its conversion mapping. Its rules are read here
(``Rename``/``StackExperts``, as ``runtime/hf_names`` names them) and each matrix loads into
the stacked parameter under a shard id (expert, part); a stacked tensor (transformers' own
state dict, as the probe loads it) is taken apart into the same matrices first.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
from torch import nn

from ...runtime.collectives import all_reduce_rows
from ...runtime.context import get_forward
from ...runtime.hf_names import Rename, StackExperts, renamed
from ...runtime.linear import RowParallelLinear, expect_shape
from ...runtime.shards import CheckpointError, CheckpointSlice, read_columns, take
from .config import refuse

# transformers' stacked weights of an experts module, the tp_plan style each must carry (None:
# the plan names it not) and the per-expert matrices each stacks where the checkpoint's
# conversion says nothing (transformers' qwen2_moe names)
WEIGHTS = {"gate_up_proj": ("packed_colwise", ("gate_proj", "up_proj")),
           "up_proj": ("colwise", ("up_proj",)),
           "down_proj": ("rowwise", ("down_proj",))}
BIASES = tuple(f"{w}_bias" for w in WEIGHTS)


@dataclass(frozen=True, eq=False)
class ExpertShard:
    """What one rank keeps of a stacked experts parameter.

    Args:
        kind: transformers' name of the parameter ("gate_up_proj", "down_proj_bias", ...).
        experts: the checkpoint's experts; ``first``, ``local``: this rank's (EP).
        inter: each expert's intermediate size; ``start``, ``size``: this rank's slice of it.
        hidden: the hidden size.
        parts: the per-expert matrices the parameter stacks, as the checkpoint names them.
        group: the TP group (the ranks that read each down projection together).
        moe_tp: the ranks that split one expert's intermediate (``group`` is moe_ep x moe_tp).
        adds_bias: a down bias joins the group's sum here (moe_tp rank 0 of each EP rank).
    """

    kind: str
    experts: int
    first: int
    local: int
    inter: int
    start: int
    size: int
    hidden: int
    parts: tuple
    group: object
    moe_tp: int
    adds_bias: bool

    def load(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """``loaded``: one expert's matrix of part ``shard_id`` = (expert, part index), or,
        without one, the stacked tensor (the biases)."""
        if shard_id is None:
            return self._load_stacked(param, loaded)
        expert, part = shard_id
        e = expert - self.first
        if self.kind == "down_proj":  # [hidden, inter]: this rank's columns
            expect_shape(loaded, self.hidden, self.inter)
            # the TP group reads each down projection together (shards.read_columns): the
            # moe_tp ranks of the expert's EP rank want their columns, the others none
            owner = expert // self.local
            wants = [((j % self.moe_tp) * self.size, self.size) if j // self.moe_tp == owner
                     else (0, 0) for j in range(self.group.size)]
            read_columns(loaded, self.group, wants, param.data[e] if 0 <= e < self.local else None)
            return
        expect_shape(loaded, self.inter, self.hidden)
        if 0 <= e < self.local:  # else another EP rank's expert
            param.data[e, part * self.size:(part + 1) * self.size].copy_(
                take(loaded, 0, self.start, self.size))

    def _load_stacked(self, param: nn.Parameter, loaded) -> None:
        if self.kind == "down_proj_bias":
            expect_shape(loaded, self.experts, self.hidden)
            if self.adds_bias:
                param.data.copy_(take(loaded, 0, self.first, self.local))
            else:  # transformers' forward adds it on every rank: zeros join the sum once
                param.data.zero_()
            return
        halves = 2 if self.kind == "gate_up_proj_bias" else 1
        expect_shape(loaded, self.experts, halves * self.inter)
        mine = take(loaded, 0, self.first, self.local)
        param.data.copy_(torch.cat([mine[:, h * self.inter + self.start:][:, :self.size]
                                    for h in range(halves)], dim=1))


def _loader(shard: ExpertShard):
    def load(param, loaded, shard_id=None):
        shard.load(param, loaded, shard_id)

    load.reads_slices = True  # the rows a rank keeps, its experts only
    return load


def make_experts_ours(experts, name: str, cfg, runtime, dtype) -> None:
    """Shard transformers' experts module ``experts`` (on the meta device; ``name`` in the
    base model) over the TP group: its stacked parameters replaced by this rank's (EP rank's
    experts, moe_tp slice of each expert's intermediate), each with a loader that cuts it from
    the checkpoint's per-expert matrices; its forward kept (its output this rank's partial sum
    over the TP group: ``owe_one_sum`` completes its block's). What it cannot split is
    refused by name."""
    model_type, cls = cfg.model_type, type(experts).__name__
    parallel = runtime.parallel
    dims, group = parallel.dims, parallel.tp_group
    what = f"{name} ({cls})"
    if not hasattr(experts, "is_concatenated"):
        raise refuse(model_type, f"{what} is not one of transformers' stacked experts modules "
                     "(use_experts_implementation)")
    params = dict(experts.named_parameters(recurse=False))
    unknown = sorted(set(params) - set(WEIGHTS) - set(BIASES))
    weights = [w for w in WEIGHTS if w in params]
    if unknown or "down_proj" not in params or len(weights) != 2:
        raise refuse(model_type, f"{what} holds {', '.join(sorted(params))}: not stacked "
                     "gate_up_proj (or up_proj) and down_proj")
    if experts.is_transposed:
        raise refuse(model_type, f"{what} stores its experts transposed ([experts, in, out]), "
                     "which the generic path does not load")
    for w in weights:
        style = cfg.style(f"{name}.{w}")
        if style not in (None, WEIGHTS[w][0]):
            raise refuse(model_type, f"{name}.{w}: tp_plan style {style!r} is not served for "
                         f"stacked experts ({WEIGHTS[w][0]} only)")
    num, hidden, inter = params["down_proj"].shape
    moe_tp, moe_ep = dims.moe_tp, dims.moe_ep
    if moe_tp > 1:
        # each rank's slice of the intermediate runs through the gate alone: only transformers'
        # default gate (act(gate) * up on the concatenated halves) is known to be elementwise
        from transformers.integrations.moe import _default_apply_gate

        custom = getattr(type(experts), "_apply_gate", _default_apply_gate)
        why = ("normalizes each expert's output (has_post_expert_norm)"
               if experts.has_post_expert_norm else
               "interleaves its gate and up rows" if not experts.is_concatenated else
               f"gates through its own {cls}._apply_gate" if custom is not _default_apply_gate
               else None)
        if why is not None:
            raise refuse(model_type, f"{what} {why}, which the generic path cannot split over "
                         f"the MoE tensor-parallel size {moe_tp}")
    try:
        if num % moe_ep:
            raise ValueError(f"{what}'s {num} experts are not divisible by the expert-parallel "
                             f"size {moe_ep}")
        if inter % moe_tp:
            raise ValueError(f"{what}'s intermediate size {inter} is not divisible by the MoE "
                             f"tensor-parallel size {moe_tp}")
    except ValueError as exc:
        raise refuse(model_type, str(exc)) from None
    local, size = num // moe_ep, inter // moe_tp
    parts = conversion(model_type)[1]
    for kind, param in params.items():
        shard = ExpertShard(kind, num, parallel.moe_ep_rank * local, local, inter,
                            parallel.moe_tp_rank * size, size, hidden,
                            parts.get(kind, WEIGHTS.get(kind, (None, ()))[1]), group, moe_tp,
                            adds_bias=parallel.moe_tp_rank == 0)
        shape = [local, *param.shape[1:]]
        if kind in ("gate_up_proj", "up_proj", "gate_up_proj_bias", "up_proj_bias"):
            shape[1] = shape[1] // inter * size
        elif kind == "down_proj":
            shape[2] = size
        ours = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        ours.weight_loader, ours.expert_shard = _loader(shard), shard
        setattr(experts, kind, ours)
    if hasattr(experts, "intermediate_dim"):
        experts.intermediate_dim = size
    if moe_ep > 1:  # transformers' own EP: other ranks' experts routed to a sentinel id
        experts.num_experts, experts._is_expert_parallel = local, True
        first = parallel.moe_ep_rank * local
        experts.register_forward_pre_hook(functools.partial(_local_ids, first, local),
                                          with_kwargs=True)


def _local_ids(first: int, local: int, module, args, kwargs):
    """The router's expert ids as this EP rank's: another rank's expert becomes ``local``,
    the id transformers' experts forwards skip (or mask) under expert parallelism."""
    args = list(args)
    index = args[1] if len(args) > 1 else kwargs["top_k_index"]
    ids = index - first
    ids = ids.masked_fill((ids < 0) | (ids >= local), local)
    if len(args) > 1:
        args[1] = ids
    else:
        kwargs["top_k_index"] = ids
    return tuple(args), kwargs


def owe_one_sum(block: nn.Module, group) -> None:
    """The FFN ``block`` holding stacked experts (its stage's compute module: transformers'
    ``mlp``) as one partial sum over the TP ``group``: its row-parallel linears (a shared
    expert's down projection) never reduce, its experts' partial joins theirs as the block
    adds them, and the block's output is left to the boundary where the exit skips the
    reduction, all-reduced once here otherwise (a stage's output is summed once: two sums of
    two partials read as two sums of one output to the exactly-once audit)."""
    for module in block.modules():
        if isinstance(module, RowParallelLinear):
            module.reduce_results = False
    if group.size > 1:
        block.register_forward_hook(functools.partial(_owed_sum, group))


def _owed_sum(group, module, args, out: torch.Tensor) -> torch.Tensor:
    if get_forward().skips_reduction:
        return out
    return all_reduce_rows(out.reshape(-1, out.shape[-1]), group).view(out.shape)


@functools.cache
def conversion(model_type: str) -> tuple[tuple, dict]:
    """transformers' checkpoint conversion of ``model_type`` as (its renames and expert
    stacks: ``Rename``/``StackExperts`` rules, {stacked parameter: the per-expert parts it
    stacks}); a conversion of another kind is refused by name."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import (Concatenate, MergeModulelist,
                                                 WeightConverter, WeightRenaming)

    rules, parts = [], {}
    for rule in get_checkpoint_conversion_mapping(model_type) or ():
        sources, targets = list(rule.source_patterns), list(rule.target_patterns)
        if type(rule) is WeightRenaming and len(sources) == len(targets) == 1:
            rules.append(Rename(sources[0], targets[0]))
            continue
        ops = [(type(op), getattr(op, "dim", None)) for op in
               getattr(rule, "operations", ())]
        found = [re.fullmatch(r"\.?(.*experts)\.\*\.([^.]+)\.weight", s) for s in sources]
        target = re.fullmatch(r"\.?(.*experts)\.([^.]+)", targets[0]) if targets else None
        merges = ops in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)])
        if (type(rule) is WeightConverter and merges and len(targets) == 1 and target
                and all(found) and {m[1] for m in found} == {target[1]}
                and (len(sources) > 1) == (len(ops) > 1)):
            stack = StackExperts(tuple(m[2] for m in found), target[2])
            rules.append(stack)
            parts[stack.to] = stack.parts
            continue
        raise refuse(model_type, f"transformers converts its checkpoint's {sources} into "
                     f"{targets} by {type(rule).__name__} "
                     f"{[op.__name__ for op, _ in ops]}, which the generic path does not read")
    return tuple(rules), parts


def expert_stacked_params(model) -> list:
    """(stacked parameter, per-expert checkpoint matrix, (expert, part)) triples of
    ``model``'s experts (``loader.load_weights``'s ``stacked``): none without experts."""
    shards = {p.expert_shard.kind: p.expert_shard for p in model.parameters()
              if hasattr(p, "expert_shard") and p.expert_shard.kind in WEIGHTS}
    return [(f"experts.{kind}", f"experts.{e}.{part}.weight", (e, i))
            for kind, shard in shards.items() for e in range(shard.experts)
            for i, part in enumerate(shard.parts)]


def checkpoint_weights(weights, model):
    """(name, tensor) of the checkpoint as the generic model's parameters take them: the
    checkpoint's own where the model has no experts; else renamed as transformers renames
    them, each stacked expert tensor (transformers' state dict) taken apart into the
    per-expert matrices a checkpoint stores (``expert_stacked_params`` loads those)."""
    shards = {name: p.expert_shard for name, p in model.named_parameters()
              if hasattr(p, "expert_shard")}
    if not shards:
        yield from weights
        return
    rules = conversion(model.config.model_type)[0]
    for name, tensor in weights:
        name = renamed(rules, name)
        local = model.local_name(name)
        shard = shards.get(local) if local is not None else None
        if shard is None or shard.kind not in WEIGHTS:
            yield name, tensor
            continue
        rows = shard.hidden if shard.kind == "down_proj" else shard.inter
        cols = shard.inter if shard.kind == "down_proj" else shard.hidden
        if tuple(tensor.shape) != (shard.experts, len(shard.parts) * rows, cols):
            raise CheckpointError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}; "
                                  f"parameter {local} stacks {shard.experts} experts' "
                                  f"{'+'.join(shard.parts)} of shape ({rows}, {cols})")
        prefix = name.rpartition(".")[0]
        for e in range(shard.experts):
            # one expert's rows (a stored stacked tensor is read an expert at a time)
            block = (take(tensor, 0, e, 1)[0] if isinstance(tensor, CheckpointSlice)
                     else tensor[e])
            for i, part in enumerate(shard.parts):
                yield f"{prefix}.{e}.{part}.weight", block[i * rows:(i + 1) * rows]
