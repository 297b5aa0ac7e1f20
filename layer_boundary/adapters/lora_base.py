"""The base-model tensors a PEFT LoRA file holds, loaded over the base model as peft loads them.

An adapter file may hold tensors that are not LoRA weights: a resized embedding and head
(peft's ``save_embedding_layers``), a norm, or a linear's own weight. peft 0.21 loads every
saved tensor whose name is one of its ``PeftModel``'s (``set_peft_model_state_dict``:
``load_state_dict(strict=False)``), over the base model's, for every request: the base
model's (adapters disabled) and every adapter's. The names are transformers' for the model's
parameters, which are not always the checkpoint's (``runtime.hf_names``: the model's
``transformers_names`` declare them): Mixtral's ``block_sparse_moe.experts.0.w1.weight`` is
part of transformers' ``mlp.experts.gate_up_proj``, a tensor under the checkpoint's name is
no parameter of peft's model, and a saved ``mlp.experts.gate_up_proj`` [experts, 2 *
intermediate, hidden] is split into the checkpoint's per-expert tensors it stacks. Its names
say which load:

* a module some loaded adapter targets is wrapped, so its own weight is
  ``<module>.base_layer.weight``; ``<module>.weight`` matches nothing and is ignored;
* any other module keeps its name: ``<module>.weight`` loads, ``<module>.base_layer.weight``
  is ignored;
* "loaded" counts the adapters loaded so far (``--lora`` order, this one included): a later
  adapter's tensor loads after, and over, an earlier one's;
* a tied head's ``lm_head.weight`` is the embedding's tensor.

A loaded tensor's shape must be transformers' parameter's (peft refuses a size mismatch); here
it must also be a finite floating-point tensor over a floating-point one (adapters do not run
on FP8 checkpoints), or the adapter is refused by name. Each is then loaded, as the
checkpoint's tensors it replaces, through the model's own checkpoint loader, so it is sharded
and placed exactly as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.hf_names import HfTensor, transformers_tensors
from .lora_config import LoraError, warn_once

_FLOATS = ("F16", "BF16", "F32", "F64")  # safetensors dtypes a loaded tensor may have
_WRAPPED = ".base_layer."
_HEAD = "lm_head"


@dataclass(frozen=True)
class BaseTensor:
    """A saved tensor that is not a LoRA weight: its key and what it names in the base
    model."""

    key: str  # as saved: base_model.model.<...>
    module: str  # the base model's module, e.g. model.layers.0.self_attn.q_proj
    name: str  # the base model's tensor (a checkpoint name), e.g. ...q_proj.weight
    wrapped: bool  # saved under the module's base_layer (peft's name once the module is a target)
    shape: tuple
    dtype: str  # safetensors' ("F32", "I32", ...)


def base_tensor(key: str, name: str, shape: tuple, dtype: str) -> BaseTensor:
    """``name`` (``key`` without peft's prefix) read as the base-model tensor it would be."""
    wrapped = _WRAPPED in name
    if wrapped:
        module, param = name.split(_WRAPPED, 1)
    else:
        module, _, param = name.rpartition(".")
    return BaseTensor(key, module, f"{module}.{param}" if module else param, wrapped, shape,
                      dtype)


@dataclass(frozen=True)
class BaseLoad:
    """One tensor an adapter loads over the base model's: from the adapter file to the
    checkpoint name the model's loader reads."""

    adapter: object  # the lora.Adapter
    tensor: BaseTensor
    target: HfTensor  # transformers' parameter it replaces: the checkpoint tensors it holds


def _linear(module: str, names: dict) -> bool:
    """Whether peft's ``all-linear`` wraps ``module``: an ``nn.Linear`` of transformers'
    model (a matrix weight, not an embedding, not the output head, not a MoE router)."""
    tensor = names.get(f"{module}.weight")
    return tensor is not None and tensor.linear


def wrapped(adapters, module: str, names: dict) -> bool:
    """Whether ``module`` (transformers' name) is a LoRA layer once ``adapters`` are loaded
    (any targets it); ``names``: ``transformers_names``."""
    for adapter in adapters:
        targets = adapter.config.targets
        if isinstance(targets, str) and targets.lower() == "all-linear":
            if _linear(module, names) and adapter.config.targets_module(module):
                return True
        elif adapter.config.targets_module(module):
            return True
    return False


def transformers_names(facts: dict, model) -> dict[str, HfTensor]:
    """{transformers' parameter name: ``HfTensor``} of the checkpoint ``facts`` describe, as
    ``model`` declares transformers names them (``CausalLM.transformers_tensors``; a model
    without the declaration: the checkpoint's names)."""
    names = getattr(model, "transformers_tensors", None)
    return names(facts) if names is not None else transformers_tensors((), facts)


def plan(read: list, facts: dict | None, model, names: dict | None = None) -> list[BaseLoad]:
    """The tensors ``read`` (the checked adapters, in load order) load over the base model,
    each checked against transformers' parameter of its name (``names``, from the
    checkpoint's headers ``facts``); those peft ignores are named in a warning. No tensor
    data read.

    Args:
        read: ``lora.Adapter``s; slot order is load order.
        facts: the base checkpoint's {name: (shape, dtype)}; None: not known (an adapter
            holding base tensors is then refused).
        model: the ``CausalLM`` they load into (whether its head is its embedding, and how
            transformers names the checkpoint's tensors).
        names: ``transformers_names(facts, model)`` where the caller has it.
    """
    loads = []
    for k, adapter in enumerate(read):
        if not adapter.base:
            continue
        if facts is None:
            raise LoraError(f"{adapter.label}: holds base-model tensors "
                            f"({adapter.base[0].key}), which peft loads over the base model's: "
                            "attach_lora needs the base checkpoint to check them against "
                            "(pass checkpoint=)")
        if names is None:
            names = transformers_names(facts, model)
        ignored, missing, renamed, mine = [], [], [], []
        for t in adapter.base:
            if t.wrapped != wrapped(read[:k + 1], t.module, names):
                ignored.append(t.key)
                continue
            target = names.get(t.name)
            if model.ties_head() and t.name == f"{_HEAD}.weight":
                embedding = _embedding(facts)
                if embedding is None:
                    raise LoraError(f"{adapter.label}: tensor {t.key} is the model's tied "
                                    "head, which is its embedding, and the checkpoint holds no "
                                    "one embedding to load it over: not supported")
                target = HfTensor(t.name, tuple(facts[embedding][0]), facts[embedding][1],
                                  (embedding,))
            if target is None:
                theirs = _renamed(t.name, names)
                if theirs is not None:
                    renamed.append(f"{t.key} (transformers' {theirs})")
                else:
                    missing.append(t.key)
                continue
            if target.dtype not in _FLOATS:
                replaced = target.sources[0] if len(target.sources) == 1 else target.name
                raise LoraError(f"{adapter.label}: tensor {t.key} would replace the "
                                f"checkpoint's {replaced}, which is {target.dtype}, not a float "
                                "weight: not supported")
            if t.dtype not in _FLOATS:
                raise LoraError(f"{adapter.label}: tensor {t.key} is {t.dtype}; base-model "
                                f"tensors must be floating point ({', '.join(_FLOATS)})")
            if tuple(t.shape) != tuple(target.shape):
                raise LoraError(f"{adapter.label}: tensor {t.key} has shape {list(t.shape)}, "
                                f"and the base model's {t.name} has {list(target.shape)} (peft "
                                "refuses it: size mismatch)")
            mine.append(BaseLoad(adapter, t, target))
        # peft's load_state_dict visits the head after the model's body: a tied head's
        # tensor lands over the embedding's
        mine.sort(key=lambda x: x.tensor.module == _HEAD)
        loads += mine
        _report(adapter.label, mine, ignored, missing, renamed)
    return loads


def _renamed(name: str, names: dict) -> str | None:
    """transformers' name for the checkpoint tensor ``name``, where transformers names it
    otherwise (None: no checkpoint tensor is so named, or transformers keeps the name)."""
    for theirs, tensor in names.items():
        if name in tensor.sources and theirs != name:
            return theirs
    return None


def _embedding(facts: dict) -> str | None:
    """The checkpoint's input embedding (a tied head's tensor), where it holds just one
    (GPT-NeoX's is ``gpt_neox.embed_in``)."""
    names = [n for n in facts
             if n.endswith(("embed_tokens.weight", "embeddings.weight", "embed_in.weight"))]
    return names[0] if len(names) == 1 else None


def _report(label: str, loads, ignored, missing, renamed) -> None:
    if loads:
        warn_once("%s: loads %d base-model tensors over the base model's, as peft does: "
                   "every request sees them (the base model's and every adapter's): %s",
                   label, len(loads), ", ".join(x.tensor.name for x in loads))
    if ignored:
        warn_once("%s: not applied, as peft does not load them: %d tensors named as no "
                   "parameter of peft's model (a targeted module's own weight is saved under "
                   "base_layer, any other module's without): %s", label, len(ignored),
                   ", ".join(ignored))
    if missing:
        warn_once("%s: not applied, as peft does not load them: %d tensors the base model "
                   "does not have: %s", label, len(missing), ", ".join(missing))
    if renamed:
        warn_once("%s: not applied, as peft does not load them: %d tensors named as the "
                   "checkpoint names them, and transformers' model (whose names peft matches) "
                   "names them otherwise: %s", label, len(renamed), ", ".join(renamed))


def read_tensors(loads: list[BaseLoad], open_file) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of every load, in order, each checked to be finite; a
    tensor transformers stacks from several checkpoint tensors split into them.

    Args:
        open_file: ``(path, label) -> safe_open handle`` (errors named as the adapter's).
    """
    out = []
    for x in loads:
        with open_file(x.adapter.file, x.adapter.label) as handle:
            try:
                t = handle.get_tensor(x.tensor.key)
            except Exception as exc:
                raise LoraError(f"{x.adapter.label}: {x.adapter.file} is not a readable "
                                f"safetensors file: tensor {x.tensor.key}: {exc}") from None
        if not bool(torch.isfinite(t).all()):
            raise LoraError(f"{x.adapter.label}: tensor {x.tensor.key} holds NaN or Inf values")
        out += x.target.split(t)
    return out


def load_over(model, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Write ``tensors`` (checked) into ``model`` through its own checkpoint loader
    (``CausalLM.rewrite_weights``: this pipeline stage's only, re-packed)."""
    if tensors:
        model.rewrite_weights(tensors)
