"""``sweep --features``: the sweep's layouts crossed with the features a run may turn on beside
its layout (two-batch overlap, split prefill, the reference and Triton fusion providers,
compiling, a LoRA adapter, a draft, batch invariance).

Each feature is the ``run`` arguments that turn it on, so a combination is checked by the
same table ``run`` asks (``capabilities``) and a refusal is counted with ``run``'s own words.
What a feature needs beyond a flag (an adapter, a draft) is made from the checkpoint itself:
a random PEFT LoRA adapter on its attention projections, and the checkpoint as its own draft
(or its NextN layer where it carries one).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path

from .sweep_layouts import Layout, layouts


class SweepFeature(enum.Enum):
    """A feature the sweep crosses with layouts (its value: the table's name)."""

    TBO = "tbo"
    SPLIT_PREFILL = "split-prefill"
    FUSIONS_REFERENCE = "fusions-reference"
    FUSIONS_TRITON = "fusions-triton"
    COMPILE = "compile"
    LORA = "lora"
    DRAFT = "draft"
    BATCH_INVARIANT = "batch-invariant"


# what each feature's row runs beside its layout (LoRA's and the draft's folders are added
# where the sweep has them)
_ARGS = {
    SweepFeature.TBO: ["--tbo", "always"],
    SweepFeature.SPLIT_PREFILL: ["--split-prefill", "2"],
    SweepFeature.FUSIONS_REFERENCE: ["--fusions", "reference"],
    SweepFeature.FUSIONS_TRITON: ["--fusions", "triton"],
    SweepFeature.COMPILE: ["--compile"],
    SweepFeature.BATCH_INVARIANT: ["--batch-invariant"],
}

ADAPTER = "sweep"  # the generated adapter's name under --lora
# the attention projections the generated adapter targets where the model has them (peft's
# names; an MLP's names are its experts' too on a MoE model, which peft adapts otherwise)
_ADAPTED = ("q_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value")


@dataclass(frozen=True)
class Combination:
    """One row of a feature sweep: a layout and the feature run on it (None: the layout
    alone, as the plain sweep runs it)."""

    layout: Layout
    feature: SweepFeature | None = None

    def name(self) -> str:
        return self.layout.name() + (f" +{self.feature.value}" if self.feature else "")


def sample_layouts(max_world: int, moe: bool, layers: int) -> list[Layout]:
    """One layout of each way the boundaries move rows, up to ``max_world``: world 1, the
    all-reduce and the variable reduce-scatter at tp 2, attention DP with a rank left without
    requests, pipeline stages, context and sequence parallelism, and, with experts, expert
    parallelism and the all-to-all dispatch."""
    wanted = [Layout(1), Layout(2, policy="ar"), Layout(2, policy="rsv"),
              Layout(4, dp=2, policy="rsv", empty=True), Layout(2, pp=2), Layout(2, cp=2),
              Layout(2, sp=True, policy="rsv")]
    if moe:
        wanted += [Layout(2, ep=2, a2a=True, policy="rs"), Layout(4, dp=2, ep=4, policy="rsv")]
    known = set(layouts(max_world, moe, layers))
    return [layout for layout in wanted if layout in known]


def combinations(features, every: bool, max_world: int, moe: bool, layers: int,
                 candidates: list[Layout] | None = None) -> list[Combination]:
    """What a sweep runs, feature by feature: without ``features`` each layout alone
    (``candidates``, else every layout up to ``max_world``); with them each feature on
    ``candidates``, else on the sample layouts (``every``: on every layout). Compiling,
    which costs a compile per layout, runs on the sample's tensor- and data-parallel
    layouts only unless ``every``."""
    if features is None:
        return [Combination(layout) for layout in
                (candidates if candidates is not None else layouts(max_world, moe, layers))]
    if candidates is not None:
        return [Combination(layout, f) for f in features for layout in candidates]
    pool = layouts(max_world, moe, layers) if every else sample_layouts(max_world, moe, layers)
    out = []
    for feature in features:
        chosen = pool
        if feature is SweepFeature.COMPILE and not every:
            chosen = [x for x in pool if x.pp == x.cp == 1 and not x.sp and not x.a2a]
        out += [Combination(layout, feature) for layout in chosen]
    return out


class NoAdapter(ValueError):
    """The sweep wrote no LoRA adapter for the model (why: the message)."""


def feature_args(feature: SweepFeature | None, checkpoint, folder: str,
                 adapter: str | None, prompts: int) -> list[str]:
    """``run``'s arguments for ``feature`` on the checkpoint at ``folder`` (``adapter``: the
    generated LoRA folder; ``prompts``: how many the row runs, alternately adapted). A LoRA
    row without an adapter raises ``NoAdapter``, the reason the row is refused."""
    if feature is None:
        return []
    if feature is SweepFeature.LORA:
        if adapter is None:
            raise NoAdapter(f"the sweep's LoRA adapter targets the attention projections peft "
                            f"names {', '.join(_ADAPTED)}; the {checkpoint.model_type} model "
                            "has none of them")
        chosen = [ADAPTER if i % 2 == 0 else "none" for i in range(prompts)]
        return ["--lora", f"{ADAPTER}={adapter}",
                *[arg for name in chosen for arg in ("--prompt-lora", name)]]
    if feature is SweepFeature.DRAFT:
        if checkpoint.model_class.nextn_layers(checkpoint.config):
            return ["--speculative-algorithm", "nextn"]
        return ["--draft-model", folder]  # the checkpoint drafts for itself
    return list(_ARGS[feature])


def write_adapter(checkpoint, folder: Path, seed: int = 0) -> Path | None:
    """A random PEFT LoRA adapter (r 4, alpha 8, ``init_lora_weights`` false: every delta
    non-zero) on the model's attention projections that peft names ``_ADAPTED``, under
    transformers' names (the model's ``transformers_names``), written to ``folder``; None
    where the model has none of them."""
    import torch
    from safetensors.torch import save_file

    from ..adapters.lora_base import transformers_names
    from ..models.estimate import meta_model
    from ..runtime import BoundaryRuntime, ParallelDims, virtual_parallel

    # the model's own reading of the names (a NextN/MTP layer stored after the stack is no
    # module of transformers': targeting it refused every LoRA row of a DeepSeek-V3 sweep)
    named = transformers_names(checkpoint.tensor_facts(),
                               meta_model(checkpoint,
                                          BoundaryRuntime(virtual_parallel(ParallelDims()))))
    targets = sorted((t for t in named.values() if t.linear and t.name.endswith(".weight")
                      and t.name.split(".")[-2] in _ADAPTED), key=lambda t: t.name)
    if not targets:
        return None
    gen = torch.Generator().manual_seed(seed)
    rank, tensors = 4, {}
    for t in targets:
        out_features, in_features = t.shape
        module = t.name[:-len(".weight")]
        tensors[f"base_model.model.{module}.lora_A.weight"] = (
            torch.randn(rank, in_features, generator=gen) / in_features ** 0.5)
        tensors[f"base_model.model.{module}.lora_B.weight"] = (
            torch.randn(out_features, rank, generator=gen) / rank ** 0.5)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 8, "lora_dropout": 0.0,
        "target_modules": sorted({t.name.split(".")[-2] for t in targets}),
        "init_lora_weights": False, "bias": "none", "task_type": "CAUSAL_LM"}))
    return folder


def parse_features(text: str) -> tuple[list[SweepFeature], bool]:
    """``--features``' value: ``sample`` or ``all`` (every feature; ``all``: on every
    layout), or a comma-separated list of feature names (on the sample layouts)."""
    if text in ("sample", "all"):
        return list(SweepFeature), text == "all"
    names = [t.strip() for t in text.split(",") if t.strip()]
    known = {f.value: f for f in SweepFeature}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        what = f"{', '.join(unknown)} is not a feature" if unknown else "names no feature"
        alone = [n for n in unknown if n in ("sample", "all")]
        if alone:  # it read "sample is not a feature (give sample, ...)"
            what = f"{alone[0]} stands alone, not among feature names"
        raise ValueError(f"--features {text!r}: {what} (give sample, all, or some of "
                         f"{', '.join(known)})")
    return [known[n] for n in dict.fromkeys(names)], False
