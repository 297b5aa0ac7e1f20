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
  the base weight's rows (the fused projection's q/k/v slots, kv heads replicated alike); a
  target that is itself a fused checkpoint tensor (GPT-NeoX's ``query_key_value``, heads-major
  q/k/v; Phi-3's ``qkv_proj`` and ``gate_up_proj``, blocks) has its ``B`` rows cut and
  permuted by the very loader its weight's rows were (``runtime/fused.py``);
* row-parallel (o, down): ``A``'s columns as the base weight's columns, ``B`` whole; the delta
  is this rank's partial, summed wherever the base partial is (the boundary's all-reduce or
  reduce-scatter, or the linear's own).

Adapters come as PEFT folders (``adapter_config.json`` + ``adapter_model.safetensors``),
meaning what they mean to peft (``lora_config.py``), their modules named as transformers'
model names them (``runtime.hf_names``, through the checkpoint's names to the model's own);
ranks may differ between adapters
(zero-padded to the largest), and each module's ``scaling`` is folded into ``B`` at load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..capabilities import Feature, check_model
from ..runtime.context import NO_ADAPTERS, adapter_rows
from ..runtime.hf_names import renamed
from ..runtime.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from . import lora_base
from .lora_config import AdapterConfig, LoraError, read_config
from .lora_config import warn_once as _warn_once

_PREFIX = "base_model.model."  # what peft's saved keys start with
_PAIR = (".lora_A.weight", ".lora_B.weight")
_FLOATS = ("F16", "BF16", "F32", "F64")  # safetensors dtypes a LoRA weight may have


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
            delta = sum(_delta(xs, getattr(self, f"A{i}")[slot], getattr(self, f"B{i}")[slot])
                        for i in range(self.parts))
            y = y.index_add(0, rows, delta.to(y.dtype))
        return y


def _delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x @ a.T @ b.T``: one adapter's delta on its rows (in the batch-invariant mode each
    product a row at a time, ``runtime.invariant``: their kernels follow how many rows share
    the adapter)."""
    return x @ a.T @ b.T


@dataclass
class Adapter:
    """One adapter folder, read and checked: its config, and for each module its config
    targets, the header facts ``{"lora_A": shape, "lora_B": shape}`` of its weights."""

    label: str  # "LoRA adapter NAME", the start of every error about it
    file: Path
    config: AdapterConfig
    modules: dict
    base: list = field(default_factory=list)  # lora_base.BaseTensor: its other tensors
    stored: dict = field(default_factory=dict)  # {module: its name in the file, where renamed}


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _open(f: Path, label: str):
    """``safe_open`` with safetensors' own errors (a truncated file, a lying header, not a
    safetensors file at all) turned into a ``LoraError`` naming the file."""
    from safetensors import safe_open

    try:
        return safe_open(str(f), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types
        raise LoraError(f"{label}: {f} is not a readable safetensors file "
                        f"({_one_line(exc)})") from None


def _split(key: str) -> tuple[str | None, str | None]:
    """(module, "lora_A" or "lora_B" or None) of a saved tensor name; module None: the name
    lacks peft's prefix (peft loads no such tensor), or is no LoRA tensor (a base-model one)."""
    if not key.startswith(_PREFIX):
        return None, None
    name = key[len(_PREFIX):]
    for suffix in _PAIR:
        if name.endswith(suffix):
            return name[:-len(suffix)], suffix[1:7]
    return (name.rpartition(".lora_")[0], None) if ".lora_" in name else (None, "base")


def read_adapter(path, name: str | None = None, model_type: str | None = None,
                 rename=None) -> Adapter:
    """A PEFT LoRA folder's config and the header of its weights, each checked as far as the
    files go (the model's shapes are ``attach_lora``'s check); no tensor data read.

    LoRA tensors for modules the config does not target are not applied (peft does not load
    them either) and are named in a warning; tensors that are no LoRA weights are kept as
    ``base`` (``lora_base``: whether peft loads them depends on every adapter loaded).

    Args:
        path: the folder (``adapter_config.json`` + ``adapter_model.safetensors``).
        name: what errors call it (default: the folder).
        model_type: the base model's, for peft's default ``target_modules``.
        rename: a LoRA module's stored name -> transformers' (peft renames LoRA tensors by
            the model's checkpoint conversion: Nemotron-H's ``backbone.`` is ``model.``);
            None: as stored.
    """
    path = Path(path)
    label = f"LoRA adapter {name or path}"
    config, ignored = read_config(path, label, model_type)
    if ignored:
        _warn_once("%s: adapter_config.json fields peft does not know, ignored as peft "
                    "ignores them: %s", label, ", ".join(ignored))
    f = path / "adapter_model.safetensors"
    if not f.is_file():
        raise LoraError(f"{label}: no adapter_model.safetensors in {path}")
    modules: dict[str, dict] = {}
    base, dropped, unprefixed, stored = [], set(), [], {}
    with _open(f, label) as handle:
        for key in handle.keys():
            module, which = _split(key)
            if module is None and which is None:
                unprefixed.append(key)
                continue
            if module is not None and rename is not None and rename(module) != module:
                stored[rename(module)], module = module, rename(module)
            if module is not None and not config.targets_module(module):
                dropped.add(module)
                continue
            if which is None:
                raise LoraError(f"{label}: tensor {key} is neither lora_A.weight nor "
                                f"lora_B.weight of {module}")
            try:
                part = handle.get_slice(key)
                shape, dtype = tuple(part.get_shape()), part.get_dtype()
            except Exception as exc:
                raise LoraError(f"{label}: {f} is not a readable safetensors file: tensor "
                                f"{key}: {_one_line(exc)}") from None
            if which == "base":  # whether peft loads it depends on every adapter's targets
                base.append(lora_base.base_tensor(key, key[len(_PREFIX):], shape, dtype))
                continue
            if dtype not in _FLOATS:
                raise LoraError(f"{label}: {module} {which} is {dtype}; LoRA weights must be "
                                f"floating point ({', '.join(_FLOATS)})")
            if len(shape) != 2:
                raise LoraError(f"{label}: {module} {which} has shape {list(shape)}, not a "
                                "matrix")
            modules.setdefault(module, {})[which] = shape
    for module, pair in sorted(modules.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoraError(f"{label}: {module} has no "
                            f"{({'lora_A', 'lora_B'} - set(pair)).pop()}")
        r, _ = config.rank_alpha(module)
        for which, rank in (("lora_A", pair["lora_A"][0]), ("lora_B", pair["lora_B"][1])):
            if rank != r:
                raise LoraError(f"{label}: {module} {which} has rank {rank}, and "
                                f"adapter_config.json gives it r={r}")
        if config.init == "orthogonal" and r % 2:
            raise LoraError(f"{label}: {module} has r={r}, and init_lora_weights='orthogonal' "
                            "needs an even rank (peft refuses it)")
    if not modules and not base:
        raise LoraError(f"{label}: adapter_config.json targets none of the modules whose "
                        f"weights {f} holds" if dropped else
                        f"{label}: {f} holds no LoRA weights under peft's {_PREFIX} prefix")
    if dropped:
        _warn_once("%s: not applied, as peft does not apply them: the weights of %d modules "
                    "adapter_config.json does not target: %s", label, len(dropped),
                    ", ".join(sorted(dropped)))
    if unprefixed:
        _warn_once("%s: not applied, as peft does not load them: %d tensors without peft's "
                    "%s prefix: %s", label, len(unprefixed), _PREFIX,
                    ", ".join(sorted(unprefixed)))
    return Adapter(label, f, config, modules, base,
                   {m: s for m, s in stored.items() if m in modules})


def _lora_name(rules, module: str) -> str:
    """A LoRA module's stored name as peft reads it: its tensor's key through the model's
    renames (``runtime.hf_names.renamed``), as peft renames LoRA keys."""
    return renamed(rules, f"{module}{_PAIR[0]}")[:-len(_PAIR[0])]


def _load(adapter: Adapter) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (A, B)} (float32) of every module it adapts (this pipeline stage's or not:
    one check for all ranks), each checked to be finite."""
    out = {}
    with _open(adapter.file, adapter.label) as handle:
        for module in sorted(adapter.modules):
            pair = []
            for which in ("lora_A", "lora_B"):
                key = f"{_PREFIX}{adapter.stored.get(module, module)}.{which}.weight"
                try:
                    t = handle.get_tensor(key)
                except Exception as exc:
                    raise LoraError(f"{adapter.label}: {adapter.file} is not a readable "
                                    f"safetensors file: tensor {key}: {_one_line(exc)}") from None
                if not torch.isfinite(t).all():
                    raise LoraError(f"{adapter.label}: {module} {which} holds NaN or Inf values")
                pair.append(t.float())
            out[module] = tuple(pair)
    return out


def _target(model, module: str, names: dict | None = None):
    """(our linear, its part, our module name) for a module as transformers names it, or None
    off this pipeline stage; the linear None where the model has none for it.

    Args:
        names: ``lora_base.transformers_names`` of the checkpoint (transformers' names ->
            the checkpoint's); None: not known, the module is read as the checkpoint's name.
    """
    if names is not None:
        tensor = names.get(f"{module}.weight")
        if tensor is None or tensor.rows:  # no linear of transformers' model
            return None, None, module
        module = tensor.sources[0][:-len(".weight")]
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


def _fused(linear) -> bool:
    """Whether ``linear`` loads a checkpoint tensor that fuses several projections
    (``runtime.fused.use_loader`` gave it its own loader): a LoRA on that tensor has its ``B``
    rows cut as the weight's were."""
    return "weight_loader" in vars(linear)


def _full_shape(linear, shard) -> tuple[int, int] | None:
    """The checkpoint's (out, in) features of the module ``linear`` (``shard``: its part of a
    fused projection) serves; None: no LoRA for it here."""
    if isinstance(linear, RowParallelLinear) and shard is None:
        return linear.weight.shape[0], linear.in_per_rank * linear.group.size
    if isinstance(linear, QKVParallelLinear):
        if shard is None and _fused(linear):  # the fused tensor: q, k and v rows
            rows = (linear.total_heads + 2 * linear.total_kv_heads) * linear.head_dim
            return rows, linear.weight.shape[1]
        if shard not in ("q", "k", "v"):
            return None
        heads = linear.total_heads if shard == "q" else linear.total_kv_heads
        return heads * linear.head_dim, linear.weight.shape[1]
    if isinstance(linear, ColumnParallelLinear) and shard is None:
        return linear.out_per_rank * linear.group.size, linear.weight.shape[1]
    return None


def attach_lora(model, adapters, checkpoint=None) -> dict[str, int]:
    """Load ``adapters`` ((name, PEFT folder) pairs) onto ``model``'s parallel linears.

    Every adapter is read and checked (its config as peft reads it, its file, its weights'
    shapes against the model's, their values finite) before any is attached. Tensors of an
    adapter that peft loads over the base model (``lora_base``: a ``base_layer`` weight, an
    embedding, a norm) are loaded over ``model``'s, in adapter order, for every request.

    Args:
        model: a ``CausalLM`` (its ``stacked_params`` name the fused projections' parts,
            its ``local_name`` the modules on this pipeline stage).
        adapters: (name, folder) pairs; slot i of ``ForwardBatch.lora_ids`` is adapter i.
        checkpoint: the base checkpoint (folder or ``models.Checkpoint``) ``model`` was
            loaded from; needed only for adapters holding base-model tensors, whose names
            and shapes are checked against it.

    Returns {name: slot}.

    Refuses (``capabilities.CapabilityError``) a model whose runtime serves batches the
    adapters do not run in, before any adapter is read; an adapter that cannot mean here what
    it means to peft, with a one-line ``LoraError`` naming it.
    """
    if getattr(model, "stack", None) is not None and getattr(model, "config", None) is not None:
        check_model(type(model), model.config, model.stack.runtime, (Feature.LORA,))
    names = [name for name, _ in adapters]
    if len(set(names)) != len(names):
        raise LoraError(f"LoRA adapter names must differ, got {names}")
    if "none" in names:
        raise LoraError("LoRA adapter none: none is --prompt-lora's name for the base model; "
                        "give the adapter another name")
    model_type = getattr(model, "model_type", None)
    rules = getattr(model, "transformers_names", ())
    read = [read_adapter(folder, name, model_type, lambda m: _lora_name(rules, m))
            for name, folder in adapters]
    facts = _facts(checkpoint)
    hf = None if facts is None else lora_base.transformers_names(facts, model)
    for adapter in read:
        converted = adapter.config.moe_converted(model_type, hf)
        if converted is not None:
            raise LoraError(f"{adapter.label}: target_modules names {converted!r}, which peft "
                            f"(0.21, on transformers 5) turns on a {model_type} model into a "
                            "LoRA on the stacked experts' or router's parameters "
                            "(target_parameters), no longer on any module of that name: not "
                            "supported")
    base = (lora_base.plan(read, facts, model, hf) if any(adapter.base for adapter in read)
            else [])
    # {linear: (our module name, {part: {slot: transformers' module}})}
    plan: dict[nn.Module, tuple[str, dict]] = {}
    for slot, adapter in enumerate(read):
        for module, pair in sorted(adapter.modules.items()):
            found = _target(model, module, hf)
            if found is None:
                continue  # another pipeline stage's layer
            linear, shard, ours = found
            absorbed = getattr(linear, "absorbed", None)  # why the linear never runs
            if absorbed:
                raise LoraError(f"{adapter.label}: {module} is a target, and the {model_type} "
                                f"model {absorbed}, so the linear never runs: an adapter on "
                                "it is not supported")
            shape = _full_shape(linear, shard)
            if shape is None:
                raise LoraError(f"{adapter.label}: {module} is a target, and the "
                                f"{model_type} model has no parallel linear for it")
            (_, a_in), (b_out, _) = pair["lora_A"], pair["lora_B"]
            leaf = module.rpartition(".")[2]
            if a_in != shape[1]:
                raise LoraError(f"{adapter.label}: {module} lora_A takes {a_in} input features, "
                                f"and the model's {leaf} takes {shape[1]} (an adapter for "
                                "another base model?)")
            if b_out != shape[0]:
                raise LoraError(f"{adapter.label}: {module} lora_B gives {b_out} output "
                                f"features, and the model's {leaf} gives {shape[0]} (an adapter "
                                "for another base model?)")
            plan.setdefault(linear, (ours, {}))[1].setdefault(shard, {})[slot] = module
    if hf is not None:
        _check_initialized(read, hf, model)
    weights = [_load(adapter) for adapter in read]
    overrides = lora_base.read_tensors(base, _open)
    built = {}
    for linear, (ours, parts) in plan.items():
        shards = []
        for shard, per_slot in parts.items():
            ab = {}
            for slot, module in per_slot.items():
                a, b = weights[slot][module]
                scaling = read[slot].config.scaling(module)
                if not bool(torch.isfinite(b * scaling).all()):
                    raise LoraError(f"{read[slot].label}: {module} lora_B times its scaling "
                                    f"{scaling:g} (lora_alpha / r) overflows a float")
                ab[slot] = (a, b * scaling)
            shards.append(_shard(linear, shard, ab, len(adapters)))
        built[linear] = LoraWeights(shards, ours)
    lora_base.load_over(model, overrides)  # every adapter checked: load and attach them all
    for linear, lora in built.items():
        linear.lora = lora
    return {name: slot for slot, name in enumerate(names)}


# initializations under which a targeted module the file holds no weights for adds a random
# delta in peft (its LoRA B is zero under the others: such a module adds nothing, as here)
_RANDOM_INIT = (False, "orthogonal")


def _check_initialized(read: list, names: dict, model) -> None:
    """Refuse an adapter whose config targets a linear of this model that its file holds no
    weights for, where peft would initialize them at random (``init_lora_weights`` false or
    orthogonal): its output would be a draw, not the adapter's.

    Args:
        read: the ``Adapter``s.
        names: ``lora_base.transformers_names`` of the checkpoint.
        model: the ``CausalLM`` (its adaptable linears on this pipeline stage).
    """
    if all(adapter.config.init not in _RANDOM_INIT for adapter in read):
        return
    # each adaptable linear under transformers' names for it (two where two of its classes
    # serve the checkpoint: Qwen3.5's language_model prefix), by its checkpoint tensor
    forms: dict[str, list[str]] = {}
    for name, tensor in sorted(names.items()):
        if tensor.linear:
            forms.setdefault(tensor.sources[0], []).append(name[:-len(".weight")])
    linears = []
    for modules in forms.values():
        found = _target(model, modules[0], names)
        if found is not None and _full_shape(found[0], found[1]) is not None:
            linears.append(modules)
    for adapter in read:
        if adapter.config.init not in _RANDOM_INIT:
            continue
        missing = [modules[0] for modules in linears
                   if not any(m in adapter.modules for m in modules)
                   and any(lora_base.wrapped([adapter], m, names) for m in modules)]
        if missing:
            raise LoraError(f"{adapter.label}: adapter_config.json targets {missing[0]} "
                            f"({len(missing)} modules in all), and {adapter.file} holds no "
                            "weights for it: peft initializes them at random "
                            f"(init_lora_weights={adapter.config.init!r}), so its output "
                            "would be a draw, not the adapter's")


def _facts(checkpoint) -> dict | None:
    """The base checkpoint's {tensor: (shape, dtype)} (None: not given): a ``Checkpoint``'s
    ``tensor_facts`` (read once), or a folder's headers."""
    from ..runtime.safetensors_files import header_facts

    if checkpoint is None:
        return None
    if hasattr(checkpoint, "tensor_facts"):
        return checkpoint.tensor_facts()
    return header_facts(checkpoint)


def _shard(linear, shard, per_slot: dict, count: int):
    """This rank's A [count, r, in] and B [count, out, r] of one part, zero where an adapter
    does not target it, loaded by the base linear's own loader (the shapes checked)."""
    rank = max(a.shape[0] for a, _ in per_slot.values())
    row = isinstance(linear, RowParallelLinear)
    weight = linear.weight
    a_all = torch.zeros(count, rank, linear.in_per_rank if row else weight.shape[1])
    b_all = torch.zeros(count, weight.shape[0], rank)
    for slot, (a, b) in per_slot.items():
        r = a.shape[0]
        if row:  # A's columns follow the base weight's; B whole
            param = nn.Parameter(torch.zeros(r, linear.in_per_rank), requires_grad=False)
            linear.weight_loader(param, a)
            a_all[slot, :r], b_all[slot, :, :r] = param.data, b
        else:  # A whole; B's rows follow the base weight's (its q/k/v slot if fused)
            param = nn.Parameter(torch.zeros(weight.shape[0], r), requires_grad=False)
            if shard is not None:
                linear.weight_loader(param, b, shard)
            else:
                linear.weight_loader(param, b)
            a_all[slot, :r], b_all[slot, :, :r] = a, param.data
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
