"""LoRA adapters on the parallel linears: many adapters in one batch, each row its own.

A forward carries each local token's adapter slot (``ForwardBatch.lora_ids``, -1: the base
model). Each stage's ``exit()`` publishes those slots on its compute rows (the table's
movement of a complete per-token value: a gather over attention DP for an FFN on the global
rows, nothing for attention on its own rows; the spec's "LoRA adapter publishes the selected
compute input's rows"), and an adapted linear adds ``scaling * B[a] @ A[a] @ x`` to each row
``x`` of adapter ``a`` inside that scope.

The adapter weights are sharded with their base linear, so the delta lands where the base
output does and is reduced with it, once:

* column-parallel (q/k/v in the fused ``qkv_proj``, gate, up): ``A`` whole, ``B``'s rows as
  the base weight's rows (the fused projection's q/k/v slots, kv heads replicated alike);
* row-parallel (o, down): ``A``'s columns as the base weight's columns, ``B`` whole; the delta
  is this rank's partial, summed wherever the base partial is (the boundary's all-reduce or
  reduce-scatter, or the linear's own).

Adapters come as PEFT folders (``adapter_config.json`` + ``adapter_model.safetensors``);
ranks may differ between adapters (zero-padded to the largest), and ``scaling`` (alpha / r,
or alpha / sqrt(r) with rsLoRA) is folded into ``B`` at load.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from ..capabilities import Feature, check_model
from ..runtime.context import NO_ADAPTERS, adapter_rows
from ..runtime.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

_PREFIX = "base_model.model."
# PEFT options this adapter does not implement: each refused by name when set
_UNSUPPORTED = ("use_dora", "fan_in_fan_out", "modules_to_save", "layer_replication",
                "rank_pattern", "alpha_pattern", "lora_bias")


class LoraError(ValueError):
    """An adapter that cannot be applied to this model, named with what is wrong."""


class LoraWeights(nn.Module):
    """One linear's adapters: for each part (one for a plain linear; q, k and v of a fused
    projection) ``A`` [adapters, r, in] and ``B`` [adapters, out, r] (this rank's shards,
    scaling folded in). Called by the linear with its input and output rows."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor]], name: str) -> None:
        super().__init__()
        self.name = name
        for i, (a, b) in enumerate(parts):
            self.register_buffer(f"A{i}", a, persistent=False)
            self.register_buffer(f"B{i}", b, persistent=False)
        self.parts = len(parts)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ids = adapter_rows()
        if ids is None:
            raise RuntimeError(f"LoRA-adapted {self.name} ran outside its stage's exit() scope: "
                               "run the stage's compute inside exit(), which publishes each "
                               "row's adapter")
        if ids is NO_ADAPTERS:
            return y
        if ids.shape[0] != x.shape[0]:
            raise RuntimeError(f"LoRA-adapted {self.name} got {x.shape[0]} rows, and its stage "
                               f"computes on {ids.shape[0]}")
        for slot in torch.unique(ids).tolist():
            if slot < 0:
                continue
            rows = torch.nonzero(ids == slot).squeeze(1)
            xs = x[rows]
            delta = sum(xs @ getattr(self, f"A{i}")[slot].T @ getattr(self, f"B{i}")[slot].T
                        for i in range(self.parts))
            y = y.index_add(0, rows, delta.to(y.dtype))
        return y


def read_adapter(path) -> tuple[dict, float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A PEFT LoRA folder: (its config, its scaling, {module path: (A, B)})."""
    from safetensors.torch import load_file

    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise LoraError(f"LoRA adapter {path}: no {f.name}")
    cfg = json.loads(config_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {path}: peft_type {cfg['peft_type']!r} is not LORA")
    for key in _UNSUPPORTED:
        if cfg.get(key):
            raise LoraError(f"LoRA adapter {path}: {key}={cfg[key]!r} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"LoRA adapter {path}: bias={cfg['bias']!r} is not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r < 1:
        raise LoraError(f"LoRA adapter {path}: r must be a positive integer, got {r!r}")
    scaling = alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        name = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        for which in ("lora_A", "lora_B"):
            marker = f".{which}."
            if marker in name:
                module = name[:name.index(marker)]
                pairs.setdefault(module, {})[which] = tensor.float()
                break
        else:
            raise LoraError(f"LoRA adapter {path}: tensor {key} is neither lora_A nor lora_B")
    out = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoraError(f"LoRA adapter {path}: {module} has no "
                            f"{({'lora_A', 'lora_B'} - set(ab)).pop()}")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.shape[0] != b.shape[1]:
            raise LoraError(f"LoRA adapter {path}: {module} lora_A has rank {a.shape[0]} and "
                            f"lora_B {b.shape[1]}")
        out[module] = (a, b)
    return cfg, scaling, out


def _target(model, module: str):
    """(our linear, its part) for a checkpoint module path, or None off this pipeline stage."""
    parent, _, leaf = module.rpartition(".")
    for fused, part, shard in model.stacked_params():
        if leaf == part:
            leaf = f"{fused}|{shard}"
            break
    local = model.local_name(f"{parent}.{leaf.split('|')[0]}.weight")
    if local is None:
        return None
    try:
        linear = model.get_submodule(local[:-len(".weight")])
    except AttributeError:
        linear = None
    shard = leaf.split("|")[1] if "|" in leaf else None
    return linear, shard, local[:-len(".weight")]


def attach_lora(model, adapters) -> dict[str, int]:
    """Load ``adapters`` ((name, PEFT folder) pairs) onto ``model``'s parallel linears.

    Args:
        model: a ``CausalLM`` (its ``stacked_params`` name the fused projections' parts,
            its ``local_name`` the modules on this pipeline stage).
        adapters: (name, folder) pairs; slot i of ``ForwardBatch.lora_ids`` is adapter i.

    Returns {name: slot}.

    Refuses (``capabilities.CapabilityError``) a model whose runtime serves batches the
    adapters do not run in, before any adapter is read.
    """
    if getattr(model, "stack", None) is not None and getattr(model, "config", None) is not None:
        check_model(type(model), model.config, model.stack.runtime, (Feature.LORA,))
    names = [name for name, _ in adapters]
    if len(set(names)) != len(names):
        raise LoraError(f"LoRA adapter names must differ, got {names}")
    loaded = [read_adapter(folder) for _, folder in adapters]
    by_linear: dict[nn.Module, dict] = {}
    for slot, ((name, folder), (_, scaling, modules)) in enumerate(zip(adapters, loaded)):
        for module, (a, b) in modules.items():
            found = _target(model, module)
            if found is None:
                continue  # another pipeline stage's layer
            linear, shard, ours = found
            if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
                raise LoraError(f"LoRA adapter {name} targets {module}, which the "
                                f"{model.model_type} model has no parallel linear for")
            by_linear.setdefault(linear, {"name": ours}).setdefault(shard, {})[slot] = (
                a, b * scaling)
    for linear, parts in by_linear.items():
        module = parts.pop("name")
        linear.lora = LoraWeights([_shard(linear, shard, per_slot, len(adapters), module)
                                   for shard, per_slot in parts.items()], module)
    return {name: slot for slot, name in enumerate(names)}


def _shard(linear, shard, per_slot: dict, count: int, module: str):
    """This rank's A [count, r, in] and B [count, out, r] of one part, zero where an adapter
    does not target it, loaded by the base linear's own loader."""
    rank = max(a.shape[0] for a, _ in per_slot.values())
    row = isinstance(linear, RowParallelLinear)
    weight = linear.weight
    a_all = torch.zeros(count, rank, linear.in_per_rank if row else weight.shape[1])
    b_all = torch.zeros(count, weight.shape[0], rank)
    for slot, (a, b) in per_slot.items():
        r = a.shape[0]
        try:
            if row:  # A's columns follow the base weight's; B whole
                param = nn.Parameter(torch.zeros(r, linear.in_per_rank), requires_grad=False)
                linear.weight_loader(param, a)
                a_all[slot, :r], b_all[slot, :, :r] = param.data, b
            else:  # A whole; B's rows follow the base weight's (its q/k/v slot if fused)
                param = nn.Parameter(torch.zeros(weight.shape[0], r), requires_grad=False)
                if isinstance(linear, QKVParallelLinear):
                    linear.weight_loader(param, b, shard)
                else:
                    linear.weight_loader(param, b)
                a_all[slot, :r], b_all[slot, :, :r] = a, param.data
        except ValueError as exc:
            raise LoraError(f"LoRA adapter for {module}: {exc}") from None
    return a_all.to(weight.dtype), b_all.to(weight.dtype)


def lora_slots(names, prompt_adapters) -> list[int]:
    """Each prompt's adapter slot (-1: ``none``, the base model), by adapter name."""
    slots = {name: i for i, name in enumerate(names)}
    out = []
    for chosen in prompt_adapters:
        if chosen == "none":
            out.append(-1)
        elif chosen in slots:
            out.append(slots[chosen])
        else:
            loaded = ", ".join(names) or "none loaded"
            raise LoraError(f"--prompt-lora {chosen}: no adapter named {chosen} ({loaded})")
    return out
