"""Transformers' names for a checkpoint's tensors: the parameters its model would have, read
from the checkpoint's own names through what a model declares of transformers' conversion.

transformers 5 renames some checkpoints' tensors as it loads them (its checkpoint conversion
mapping: Mixtral's ``block_sparse_moe`` is ``mlp``, GPT-NeoX's ``embed_out`` is ``lm_head``)
and stacks others, one per expert, into one parameter (``experts.gate_up_proj``
[experts, 2 * intermediate, hidden]). peft names an adapter's tensors as that model names its
parameters, so an adapter is read through them. A model class declares the rules
(``CausalLM.transformers_names``), applied to each checkpoint name as transformers applies
its own: every ``Rename`` that matches, in order, then at most one ``StackExperts``. They are
written for their effect (transformers undoes a rename whose result is no parameter of its
model; a rule here says only what holds). transformers itself is never imported: the rules
are the model's declaration, and the tests hold them against transformers' parameters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Rename:
    """transformers' ``WeightRenaming``: the first match of ``pattern`` in a checkpoint name
    replaced by ``to`` (``re.sub``, groups allowed)."""

    pattern: str
    to: str


@dataclass(frozen=True)
class Alias:
    """A second name transformers gives a tensor where two of its classes serve the
    checkpoint and name it differently (Qwen3.5's multimodal class keeps
    ``model.language_model.``, its text class, which ``AutoModelForCausalLM`` loads, drops
    it): ``pattern`` replaced by ``to``, after the renames."""

    pattern: str
    to: str


@dataclass(frozen=True)
class StackExperts:
    """transformers' ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``: the per-expert
    matrices ``<...>.experts.<e>.<part>.weight`` (named after the renames) of the ``parts``
    stacked into one parameter ``<...>.experts.<to>`` [experts, the parts' rows in order,
    columns] (``gate_up_proj``: each expert's gate rows, then its up rows).

    ``count``: the config fields whose sum is the experts transformers' parameter holds
    (LongCat-Flash's gate_up_proj counts its identity experts too, rows no forward reads,
    which a checkpoint may or may not store); () as many as the checkpoint stores."""

    parts: tuple[str, ...]
    to: str
    count: tuple[str, ...] = ()


@dataclass(frozen=True)
class NotLinear:
    """Modules (full matches of ``pattern``) that transformers builds with a matrix weight but
    not as an ``nn.Linear`` (its MoE routers): peft's ``all-linear`` leaves them alone."""

    pattern: str


@dataclass(frozen=True)
class HfTensor:
    """One parameter (or persistent buffer) of transformers' model and the checkpoint tensors
    it holds."""

    name: str  # transformers' name, e.g. model.layers.1.mlp.experts.gate_up_proj
    shape: tuple[int, ...]
    dtype: str  # safetensors' ("F32", "BF16", ...)
    sources: tuple[str, ...]  # checkpoint names; stacked: expert-major, parts in order
    rows: tuple[int, ...] = ()  # stacked: each part's rows; () a plain tensor
    linear: bool = False  # the weight of an nn.Linear (peft's all-linear wraps it)

    def split(self, tensor) -> list[tuple[str, object]]:
        """``tensor`` (of this parameter's shape) as the checkpoint tensors it holds:
        (checkpoint name, its rows) pairs; a stacked parameter's experts past the checkpoint's
        (``StackExperts.count``) are left out."""
        if not self.rows:
            return [(self.sources[0], tensor)]
        out, k = [], 0
        for e in range(len(self.sources) // len(self.rows)):
            start = 0
            for rows in self.rows:
                out.append((self.sources[k], tensor[e, start:start + rows]))
                start, k = start + rows, k + 1
        return out


# what several models declare: transformers' "qwen2_moe" conversion (each expert's gate and up
# stacked into gate_up_proj, its down into down_proj), and a MoE router (``mlp.gate``) built as
# transformers' own module, not an nn.Linear
GATE_UP_EXPERTS = (StackExperts(("gate_proj", "up_proj"), "gate_up_proj"),
                   StackExperts(("down_proj",), "down_proj"))
MLP_ROUTER = NotLinear(r".*\.mlp\.gate")

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<part>[^.]+)\.weight$")


def natural_key(name: str) -> list:
    """transformers' order of checkpoint names (``dot_natural_key``: numbers as numbers);
    where two tensors get one name, the first in it is the parameter."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def renamed(rules, name: str) -> str:
    """``name`` through the rules' ``Rename``s, in order (peft 0.21 renames an adapter's LoRA
    tensors so, for a model transformers converts by its model type)."""
    for rule in rules:
        if isinstance(rule, Rename):
            name = re.sub(rule.pattern, rule.to, name, count=1)
    return name


def transformers_tensors(rules, facts: dict, config=None) -> dict[str, HfTensor]:
    """{transformers' name: ``HfTensor``} of a checkpoint's tensors.

    Args:
        rules: the model's ``Rename``/``Alias``/``StackExperts``/``NotLinear`` declarations.
        facts: the checkpoint's {name: (shape, safetensors dtype)} (its headers).
        config: the model's config (``StackExperts.count``'s fields).
    """
    stacks = [r for r in rules if isinstance(r, StackExperts)]
    not_linear = [re.compile(r.pattern) for r in rules if isinstance(r, NotLinear)]
    out: dict[str, HfTensor] = {}
    groups: dict[str, tuple[StackExperts, dict]] = {}
    for name in sorted(facts, key=natural_key):
        hf = renamed(rules, name)
        m = _EXPERT.match(hf)
        stack = next((s for s in stacks if m and m["part"] in s.parts), None)
        if stack is not None:
            found = groups.setdefault(f"{m['prefix']}.{stack.to}", (stack, {}))[1]
            found[int(m["e"]), stack.parts.index(m["part"])] = name
            continue
        shape, dtype = facts[name]
        module = hf[:-len(".weight")] if hf.endswith(".weight") else None
        linear = (module is not None and len(shape) == 2 and module != "lm_head"
                  and "embed" not in module.rpartition(".")[2]
                  and not any(p.fullmatch(module) for p in not_linear))
        out.setdefault(hf, HfTensor(hf, tuple(shape), dtype, (name,), linear=linear))
    for target, (stack, found) in groups.items():
        tensor = _stacked(target, stack, found, facts, config)
        if tensor is not None:
            out.setdefault(target, tensor)
    for rule in (r for r in rules if isinstance(r, Alias)):
        for name, tensor in list(out.items()):
            alias = re.sub(rule.pattern, rule.to, name, count=1)
            if alias != name:
                out.setdefault(alias, replace(tensor, name=alias))
    return out


def _stacked(target: str, stack: StackExperts, found: dict, facts: dict,
             config) -> HfTensor | None:
    """The stacked parameter of ``found`` ({(expert, part): checkpoint name}), or None where
    they do not make one (an expert or part missing, shapes that differ): transformers could
    not load such a checkpoint, so no parameter of its is named ``target``."""
    experts = 1 + max(e for e, _ in found)
    names = [found.get((e, p)) for e in range(experts) for p in range(len(stack.parts))]
    if None in names:
        return None
    shapes = [tuple(facts[n][0]) for n in names]
    per_part = shapes[:len(stack.parts)]
    if (any(len(s) != 2 for s in per_part) or len({s[1] for s in per_part}) != 1
            or shapes != per_part * experts or len({facts[n][1] for n in names}) != 1):
        return None
    count = sum(int(getattr(config, f, 0) or 0) for f in stack.count) or experts
    if count < experts:
        return None
    rows = tuple(s[0] for s in per_part)
    return HfTensor(target, (count, sum(rows), per_part[0][1]), facts[names[0]][1],
                    tuple(names), rows)


__all__ = ["GATE_UP_EXPERTS", "MLP_ROUTER", "Alias", "HfTensor", "NotLinear", "Rename",
           "StackExperts", "natural_key", "renamed", "transformers_tensors"]
