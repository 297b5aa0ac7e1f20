"""The base-model tensors a PEFT LoRA file holds, loaded over the base model as peft loads them.

An adapter file may hold tensors that are not LoRA weights: a resized embedding and head
(peft's ``save_embedding_layers``), a norm, or a linear's own weight. peft 0.21 loads every
saved tensor whose name is one of its ``PeftModel``'s (``set_peft_model_state_dict``:
``load_state_dict(strict=False)``), over the base model's, for every request: the base
model's (adapters disabled) and every adapter's. Its names say which do:

* a module some loaded adapter targets is wrapped, so its own weight is
  ``<module>.base_layer.weight``; ``<module>.weight`` matches nothing and is ignored;
* any other module keeps its name: ``<module>.weight`` loads, ``<module>.base_layer.weight``
  is ignored;
* "loaded" counts the adapters loaded so far (``--lora`` order, this one included): a later
  adapter's tensor loads after, and over, an earlier one's;
* a tied head's ``lm_head.weight`` is the embedding's tensor.

A loaded tensor's shape must be the checkpoint's (peft refuses a size mismatch); here it must
also be a finite floating-point tensor over a floating-point one (adapters do not run on FP8
checkpoints), or the adapter is refused by name. Each is then loaded through the model's own
checkpoint loader, so it is sharded and placed exactly as the checkpoint's tensor of that name
was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    target: str  # the checkpoint tensor it replaces


def _linear(module: str, facts: dict) -> bool:
    """Whether peft's ``all-linear`` wraps ``module``: a matrix weight in the checkpoint, not
    an embedding, not the output head."""
    fact = facts.get(f"{module}.weight")
    return (fact is not None and len(fact[0]) == 2 and module != _HEAD
            and "embed" not in module.rpartition(".")[2])


def wrapped(adapters, module: str, facts: dict) -> bool:
    """Whether ``module`` is a LoRA layer once ``adapters`` are loaded (any targets it)."""
    for adapter in adapters:
        targets = adapter.config.targets
        if isinstance(targets, str) and targets.lower() == "all-linear":
            if _linear(module, facts) and adapter.config.targets_module(module):
                return True
        elif adapter.config.targets_module(module):
            return True
    return False


def transformers_names(facts: dict, model) -> dict[str, str]:
    """{a tensor's name as transformers may give it: the checkpoint's name}: each checkpoint
    tensor under its own name and under the model's for it (they differ where a model renames
    the checkpoint: Qwen3.5's language_model prefix; GPT-NeoX's names are the checkpoint's)."""
    return {**{model.checkpoint_name(n) or n: n for n in facts}, **{n: n for n in facts}}


def plan(read: list, facts: dict | None, model) -> list[BaseLoad]:
    """The tensors ``read`` (the checked adapters, in load order) load over the base model,
    each checked against the checkpoint (``facts``: its
    ``runtime.safetensors_files.header_facts``); those peft ignores are named in a warning.
    No tensor data read.

    Args:
        read: ``lora.Adapter``s; slot order is load order.
        facts: the base checkpoint's {name: (shape, dtype)}; None: not known (an adapter
            holding base tensors is then refused).
        model: the ``CausalLM`` they load into (whether its head is its embedding, and its
            names for the checkpoint's tensors, as transformers names them).
    """
    loads = []
    # transformers' name -> the checkpoint's (they differ where a model renames), and
    # transformers' name -> (shape, dtype)
    names = known = None
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
            known = {name: facts[ours] for name, ours in names.items()}
        ignored, missing, mine = [], [], []
        for t in adapter.base:
            if t.wrapped != wrapped(read[:k + 1], t.module, known):
                ignored.append(t.key)
                continue
            target = names.get(t.name)
            if model.ties_head() and t.name == f"{_HEAD}.weight":
                target = _embedding(facts)
                if target is None:
                    raise LoraError(f"{adapter.label}: tensor {t.key} is the model's tied "
                                    "head, which is its embedding, and the checkpoint holds no "
                                    "one embedding to load it over: not supported")
            if target is None:
                missing.append(t.key)
                continue
            shape, dtype = facts[target]
            if dtype not in _FLOATS:
                raise LoraError(f"{adapter.label}: tensor {t.key} would replace the "
                                f"checkpoint's {target}, which is {dtype}, not a float "
                                "weight: not supported")
            if t.dtype not in _FLOATS:
                raise LoraError(f"{adapter.label}: tensor {t.key} is {t.dtype}; base-model "
                                f"tensors must be floating point ({', '.join(_FLOATS)})")
            if tuple(t.shape) != tuple(shape):
                raise LoraError(f"{adapter.label}: tensor {t.key} has shape {list(t.shape)}, "
                                f"and the base model's {target} has {list(shape)} (peft "
                                "refuses it: size mismatch)")
            mine.append(BaseLoad(adapter, t, target))
        # peft's load_state_dict visits the head after the model's body: a tied head's
        # tensor lands over the embedding's
        mine.sort(key=lambda x: x.tensor.module == _HEAD)
        loads += mine
        _report(adapter.label, mine, ignored, missing)
    return loads


def _embedding(facts: dict) -> str | None:
    """The checkpoint's input embedding (a tied head's tensor), where it holds just one."""
    names = [n for n in facts if n.endswith(("embed_tokens.weight", "embeddings.weight"))]
    return names[0] if len(names) == 1 else None


def _report(label: str, loads, ignored, missing) -> None:
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


def read_tensors(loads: list[BaseLoad], open_file) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of every load, in order, each checked to be finite.

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
        out.append((x.target, t))
    return out


def load_over(model, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Write ``tensors`` (checked) into ``model`` through its own checkpoint loader
    (``CausalLM.rewrite_weights``: this pipeline stage's only, re-packed)."""
    if tensors:
        model.rewrite_weights(tensors)
