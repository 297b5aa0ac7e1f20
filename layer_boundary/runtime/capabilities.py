"""Which features combine: the one table of combination rules that every caller asks.

A run turns on a set of ``Feature``s for a model on a parallel layout. Three tables of records
decide whether the library runs it:

- ``PAIRS``: two features that do not combine yet, and why;
- ``MODEL_RULES``: what a feature needs the model class to declare (its ``register_model``
  capabilities: ``context_parallel``, ``sequence_parallel``, ``attn_input_scattered``,
  ``moe_a2a``, ``batch_invariant``, ``check_parallel``, NextN layers) or a draft to be
  (``positional_cache``, the target's vocabulary, a topology it shards over);
- ``LAYOUT_RULES``: what a feature needs of the layout and the boundary-reduction policy.

A pair that ``PAIRS`` does not list is supported, and runs (``tests/test_combinations.py``
proves each one). The command line asks ``check`` before any rank starts, the engine's
``run_rank`` before anything is built, and the library wherever the facts are first known:
``BoundaryRuntime`` (batch variants, MoE backend, topology, policy), model construction (the
model's declarations, an FP8 config), ``attach_lora`` and ``compile_forward`` (each with the
batch-invariant mode where it is on: ``runtime.invariant``). So an engine that uses the library
without the command line gets the same refusal, by name, before any allocation or collective.
Every refusal is one line naming the flags and fields involved.

It lives in the runtime, which imports nothing above itself, because ``BoundaryRuntime``
asks it when built; ``layer_boundary.capabilities`` re-exports its public names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from collections.abc import Callable

from .forward_batch import BatchVariant
from .invariant import BATCH_INVARIANT


class CapabilityError(ValueError):
    """A combination the library does not run, named with its flags and fields."""


class Feature(enum.Enum):
    """What a run may turn on beyond tensor and attention-data parallelism (in the order the
    docs' table lists them)."""

    CP = "context parallelism"
    SEQUENCE_PARALLEL = "sequence parallelism"
    INPUT_SCATTERED = "input-scattered attention"
    MOE_A2A = "MoE all-to-all dispatch"
    PIPELINE = "pipeline parallelism"
    TBO = "two-batch overlap"
    SPLIT_PREFILL = "split prefill"
    COMPILE = "torch.compile"
    SPECULATIVE = "speculative decoding"
    LORA = "LoRA adapters"
    FP8 = "FP8 checkpoints"
    FUSIONS = "fusion providers"
    BATCH_INVARIANT = "batch-invariant numerics"

    @property
    def flag(self) -> str:
        """How the command line turns it on."""
        return _NAMES[self][0]

    @property
    def field(self) -> str:
        """How the library API turns it on."""
        return _NAMES[self][1]

    @property
    def short(self) -> str:
        """Its column in the docs' table."""
        return _NAMES[self][2]


# (command-line flag, library field, short name) of each feature, as messages and docs name it
_NAMES = {
    Feature.CP: ("--cp", "ParallelDims.attn_cp", "CP"),
    Feature.SEQUENCE_PARALLEL: ("--sequence-parallel", "BatchVariant.SEQUENCE_PARALLEL", "SP"),
    Feature.INPUT_SCATTERED: ("--attn-input-scattered", "BatchVariant.INPUT_SCATTERED", "IS"),
    Feature.MOE_A2A: ("--moe-a2a-backend all_to_all", "BoundaryRuntime.moe_a2a_backend",
                      "A2A"),
    Feature.PIPELINE: ("--pp", "ParallelDims.pp", "PP"),
    Feature.TBO: ("--tbo", "ForwardBatch.tbo", "TBO"),
    Feature.SPLIT_PREFILL: ("--split-prefill", "ForwardBatch.layer_segment", "split"),
    Feature.COMPILE: ("--compile", "torch.compile", "compile"),
    Feature.SPECULATIVE: ("speculative decoding (--draft-model, --speculative-algorithm)",
                          "speculative_generate", "spec"),
    Feature.LORA: ("--lora", "attach_lora", "LoRA"),
    Feature.FP8: ("an FP8 checkpoint", "config.json quantization_config", "FP8"),
    Feature.FUSIONS: ("--fusions", "install_fusion", "fusions"),
    Feature.BATCH_INVARIANT: ("--batch-invariant", "runtime.invariant.batch_invariant", "BI"),
}


@dataclass(frozen=True)
class PairRule:
    """Two features that do not combine yet (``first`` before ``second`` in enum order)."""

    first: Feature
    second: Feature
    why: str

    def message(self) -> str:
        return (f"{self.first.flag} does not combine with {self.second.flag} yet "
                f"({self.first.field}, {self.second.field}): {self.why}")


def _pair(a: Feature, b: Feature, why: str) -> PairRule:
    order = list(Feature)
    first, second = sorted((a, b), key=order.index)
    return PairRule(first, second, why)


F = Feature
PAIRS: tuple[PairRule, ...] = (
    _pair(F.CP, F.SEQUENCE_PARALLEL, "a forward is one batch variant, and on a CP topology "
          "every forward is a CP batch"),
    _pair(F.CP, F.INPUT_SCATTERED, "a forward is one batch variant, and on a CP topology "
          "every forward is a CP batch"),
    _pair(F.SEQUENCE_PARALLEL, F.INPUT_SCATTERED, "a forward is one batch variant"),
    _pair(F.CP, F.MOE_A2A, "a MoE that dispatches from the residual's rows has no CP batch "
          "paths (under CP an FFN computes on the replicated rows)"),
    _pair(F.SEQUENCE_PARALLEL, F.MOE_A2A, "a MoE that dispatches from the residual's rows has "
          "no sequence-parallel batch paths"),
    _pair(F.CP, F.COMPILE, "a CP batch's shares come from its per-request lengths on the "
          "host, and it is not padded to a token bucket"),
    _pair(F.CP, F.SPECULATIVE, "the speculative driver builds batches without every DP "
          "rank's request lengths, which CP shares are cut from"),
    _pair(F.SEQUENCE_PARALLEL, F.LORA, "a sequence-parallel linear gathers its input rows "
          "itself, and the adapter slots are published on the stage's compute rows"),
    _pair(F.SEQUENCE_PARALLEL, F.FP8, "a quantized read's compute input does not pass "
          "through a sequence-parallel linear's gather"),
    _pair(F.MOE_A2A, F.COMPILE, "the dispatch sizes come from the routing, on the host "
          "(data-dependent shapes)"),
    _pair(F.PIPELINE, F.TBO, "two-batch overlap runs the whole stack on one pipeline stage"),
    _pair(F.PIPELINE, F.COMPILE, "a compiled forward is one stage's whole forward as one "
          "graph, without the pipeline's send and receive"),
    _pair(F.PIPELINE, F.SPECULATIVE, "the speculative driver runs every forward through the "
          "whole stack on one pipeline stage"),
    _pair(F.TBO, F.SPLIT_PREFILL, "two-batch overlap runs the whole stack in one call, not "
          "in layer segments"),
    _pair(F.TBO, F.SPECULATIVE, "the speculative driver builds plain batches, not two "
          "microbatches"),
    _pair(F.SPLIT_PREFILL, F.SPECULATIVE, "the speculative driver runs each forward through "
          "the whole stack, not in layer segments"),
    _pair(F.COMPILE, F.LORA, "an adapted linear picks each row's adapter by data-dependent "
          "indexing, a graph break under fullgraph"),
    _pair(F.LORA, F.FP8, "an FP8 checkpoint's stages read their inputs quantized, and peft's "
          "adapter beside an FP8 linear reads the unquantized input"),
    _pair(F.TBO, F.BATCH_INVARIANT, "two-batch overlap's split follows the batch and its sums "
          "run asynchronously"),
    _pair(F.COMPILE, F.BATCH_INVARIANT, "a compiled graph's kernels follow its token bucket"),
    _pair(F.SPECULATIVE, F.BATCH_INVARIANT, "verification runs a request's draft tokens as "
          "the rows of one batch"),
)
del F


@dataclass(frozen=True)
class GraphRule:
    """A feature under which a run's forwards cannot be one static batch shape per token
    bucket, so its decode steps run eagerly rather than from CUDA graphs (not a refusal: the
    run goes on, and its report says ``why``)."""

    feature: Feature
    why: str


F = Feature
GRAPH_RULES: tuple[GraphRule, ...] = (
    GraphRule(F.SPECULATIVE, "speculative verification builds its own batches"),
    GraphRule(F.TBO, "two-batch overlap splits each forward by its requests"),
    GraphRule(F.PIPELINE, "a pipeline stage's input arrives between forwards"),
    GraphRule(F.CP, "a CP batch splits by its requests' lengths"),
    GraphRule(F.LORA, "LoRA adapters pick each token's adapter per batch"),
    GraphRule(F.MOE_A2A, "the all-to-all MoE sizes its dispatch on the host"),
    GraphRule(F.BATCH_INVARIANT, "batch-invariant attention runs a request a call, which a "
                                 "padded step does not"),
)
del F


def graph_blocker(features) -> str | None:
    """Why a run with ``features`` on runs its decode steps eagerly rather than from CUDA
    graphs (the first of ``GRAPH_RULES`` that applies), or None."""
    return next((rule.why for rule in GRAPH_RULES if rule.feature in features), None)


@dataclass(frozen=True)
class Setup:
    """The facts a verdict reads: what is on and, where known, the model and the layout.

    Args:
        features: the features the run turns on.
        model: the target's model class (its ``register_model`` capabilities), or None.
        config: its parsed config (``check_parallel``, its experts, its NextN layers).
        dims: the ``ParallelDims``, or None.
        policy: the resolved boundary-reduction policy (ar | rs | rsv | rs+rsv), or None.
        draft: the draft checkpoint's model class, or None (no draft, or a NextN draft).
        draft_config: the draft's parsed config.
        nextn: drafting with the target's own NextN layers.
        folder: the target checkpoint's folder, as messages name it.
    """

    features: frozenset
    model: type | None = None
    config: object = None
    dims: object = None
    policy: str | None = None
    draft: type | None = None
    draft_config: object = None
    nextn: bool = False
    folder: str | None = None


@dataclass(frozen=True)
class Rule:
    """What ``feature`` (None: every run) needs of the model, the draft or the layout:
    ``refusal(setup)`` is the one-line message where the setup lacks it, else None (also
    where the facts it reads are not known yet)."""

    feature: Feature | None
    needs: str
    refusal: Callable[[Setup], str | None]


def _declared(capability: str, what: str, detail: Callable[[Setup], str] = lambda s: ""):
    """A model rule: the class's registered ``capability`` is True, or its refusal names it."""

    def refusal(setup: Setup) -> str | None:
        reason = getattr(setup.model, f"{capability}_refusal", None)
        if setup.model is None or reason is None:
            return None
        return f"{setup.model.model_type} cannot run {what}{detail(setup)}: {reason}"

    return refusal


def _sharding(setup: Setup) -> str | None:
    if setup.model is None or setup.dims is None or setup.config is None:
        return None
    try:
        setup.model.check_parallel(setup.config, setup.dims)
    except ValueError as exc:
        return str(exc)
    return None


def _invariant_layout(setup: Setup) -> str | None:
    layout = getattr(setup.model, "batch_invariant_layout", None)
    if layout is None or setup.dims is None or setup.config is None:
        return None
    reason = layout(setup.config, setup.dims)
    if reason is None:
        return None
    return (f"{setup.model.model_type} cannot run {Feature.BATCH_INVARIANT.flag} "
            f"({Feature.BATCH_INVARIANT.field}) with attention DP {setup.dims.attn_dp}: {reason}")


def _nextn_layers(setup: Setup) -> str | None:
    if not setup.nextn or setup.model is None or setup.config is None:
        return None
    if setup.model.nextn_layers(setup.config):
        return None
    where = f"{setup.folder} " if setup.folder else ""
    return (f"--speculative-algorithm nextn needs a checkpoint with its own NextN layer "
            f"(config.json num_nextn_predict_layers > 0); {where}({setup.model.model_type}) "
            "has none")


def _draft_vocab(setup: Setup) -> str | None:
    if setup.draft is None or setup.config is None or setup.draft_config is None:
        return None
    mine, theirs = setup.draft_config.vocab_size, setup.config.vocab_size
    if mine == theirs:
        return None
    return f"draft vocab_size={mine} differs from the target's vocab_size={theirs}"


def _draft_sharding(setup: Setup) -> str | None:
    if setup.draft is None or setup.dims is None or setup.draft_config is None:
        return None
    cp = _declared("context_parallel", "context parallelism",
                   lambda s: f" (attn_cp={s.dims.attn_cp})")
    if setup.dims.attn_cp > 1:
        message = cp(Setup(setup.features, setup.draft, dims=setup.dims))
        if message is not None:
            return message
    return _sharding(Setup(setup.features, setup.draft, setup.draft_config, setup.dims))


def _draft_cache(setup: Setup) -> str | None:
    if setup.draft is None or setup.draft.positional_cache:
        return None
    return (f"a {setup.draft.model_type} draft keeps state that folds every token in (Mamba "
            "states, a sliding-window ring): drafts need a positional KV cache")


def _scattered_residual(feature: Feature):
    """A variant whose rows stay scattered over attention TP needs a reduce-scatter policy
    wherever there is more than one rank to scatter over."""

    def refusal(setup: Setup) -> str | None:
        if setup.policy != "ar" or setup.dims is None or setup.dims.tp == 1:
            return None
        return (f"{feature.flag} needs a scattered residual: --boundary-reduction ar "
                "(BoundaryRuntime.boundary_reduction) permits no reduce-scatter (use rs, rsv "
                "or rs+rsv)")

    return refusal


def _dispatch_rows(setup: Setup) -> str | None:
    dims = setup.dims
    if setup.policy != "ar" or dims is None or dims.attn_tp == 1:
        return None
    return (f"{Feature.MOE_A2A.flag} dispatches from rows no other rank holds: with attention "
            f"TP {dims.attn_tp} those are the scattered rows, and --boundary-reduction ar "
            "(BoundaryRuntime.boundary_reduction) has none (use rs, rsv or rs+rsv, or --dp "
            "equal to --tp)")


def _compiled_scatter(setup: Setup) -> str | None:
    if (Feature.COMPILE not in setup.features or setup.policy != "rsv" or setup.dims is None
            or setup.dims.attn_tp == 1):
        return None
    return (f"{Feature.SEQUENCE_PARALLEL.flag} with {Feature.COMPILE.flag} needs a padded "
            "reduce-scatter permitted (--boundary-reduction rs or rs+rsv): a compiled prefill "
            f"of fewer rows than attention TP ({setup.dims.attn_tp}) leaves a rank none under "
            "rsv, and every rank's graph must have the same shapes")


def _refused_feature(setup: Setup) -> str | None:
    refused = getattr(setup.model, "refused_features", None) or {}
    for feature in setup.features:
        if feature in refused:
            return f"{setup.model.model_type} cannot run {feature.flag}: {refused[feature]}"
    return None


MODEL_RULES: tuple[Rule, ...] = (
    Rule(None, "the model's config shards over the topology (its check_parallel)", _sharding),
    Rule(None, "the model serves each feature asked (none of its refused_features)",
         _refused_feature),
    Rule(Feature.CP, "the model declares context_parallel",
         _declared("context_parallel", "context parallelism",
                   lambda s: f" (attn_cp={s.dims.attn_cp})" if s.dims else "")),
    Rule(Feature.SEQUENCE_PARALLEL, "the model declares sequence_parallel",
         _declared("sequence_parallel", "sequence parallelism")),
    Rule(Feature.INPUT_SCATTERED, "the model declares attn_input_scattered (an MLA latent)",
         _declared("attn_input_scattered", "input-scattered attention")),
    Rule(Feature.MOE_A2A, "the model declares moe_a2a (it has MoE layers)",
         _declared("moe_a2a", "moe_a2a_backend=all_to_all")),
    Rule(Feature.BATCH_INVARIANT, "the model declares batch_invariant",
         _declared("batch_invariant", "--batch-invariant (runtime.invariant.batch_invariant)")),
    Rule(Feature.BATCH_INVARIANT, "the model's batch invariance holds on the layout (its "
         "batch_invariant_layout: under attention DP, batch_invariant_dp)", _invariant_layout),
    Rule(Feature.SPECULATIVE, "a NextN draft: the checkpoint carries NextN layers",
         _nextn_layers),
    Rule(Feature.SPECULATIVE, "a draft checkpoint: the target's vocabulary", _draft_vocab),
    Rule(Feature.SPECULATIVE, "a draft checkpoint: it shards over the topology",
         _draft_sharding),
    Rule(Feature.SPECULATIVE, "a draft checkpoint: a positional KV cache (positional_cache)",
         _draft_cache),
)

LAYOUT_RULES: tuple[Rule, ...] = (
    # (an input-scattered batch under ar takes the ar path: there is no gather to move the
    # latent across, and its numbers are the ordinary batch's)
    Rule(Feature.SEQUENCE_PARALLEL, "a reduce-scatter policy (rs, rsv or rs+rsv) at tp > 1 "
         "(its residual stays scattered: there is no ar path)",
         _scattered_residual(Feature.SEQUENCE_PARALLEL)),
    Rule(Feature.MOE_A2A, "a reduce-scatter policy where attention TP > 1", _dispatch_rows),
    Rule(Feature.SEQUENCE_PARALLEL, "compiled: a padded reduce-scatter permitted (rs or rs+rsv)",
         _compiled_scatter),
)


def pair_rule(a: Feature, b: Feature) -> PairRule | None:
    """The rule refusing ``a`` with ``b`` (either order), or None: they combine."""
    for rule in PAIRS:
        if {rule.first, rule.second} == {a, b}:
            return rule
    return None


def refusals(setup: Setup) -> list[str]:
    """Every refusal ``setup`` meets, in table order: pairs, then model, then layout rules."""
    out = [rule.message() for rule in PAIRS
           if rule.first in setup.features and rule.second in setup.features]
    for rule in MODEL_RULES + LAYOUT_RULES:
        if rule.feature is None or rule.feature in setup.features:
            message = rule.refusal(setup)
            if message is not None:
                out.append(message)
    return out


def check(setup: Setup) -> None:
    """Raise ``CapabilityError`` with the first refusal ``setup`` meets.

    Args:
        setup: what is on, and the model and layout as far as the caller knows them.
    """
    found = refusals(setup)
    if found:
        raise CapabilityError(found[0])


def runtime_features(runtime) -> frozenset:
    """The features a ``BoundaryRuntime`` turns on: its batch variants, its MoE backend, a
    CP or pipeline topology."""
    dims = runtime.parallel.dims
    variants = set(runtime.batch_variants)
    on = {Feature.CP: dims.attn_cp > 1 or BatchVariant.CP in variants,
          Feature.SEQUENCE_PARALLEL: BatchVariant.SEQUENCE_PARALLEL in variants,
          Feature.INPUT_SCATTERED: BatchVariant.INPUT_SCATTERED in variants,
          Feature.MOE_A2A: runtime.moe_a2a_backend != "none",
          Feature.PIPELINE: dims.pp > 1}
    return frozenset(f for f, yes in on.items() if yes)


def check_runtime(runtime) -> None:
    """What a ``BoundaryRuntime`` alone shows: its features against each other, its layout
    and its policy (``BoundaryRuntime`` calls it when built)."""
    check(Setup(runtime_features(runtime), dims=runtime.parallel.dims,
                policy=runtime.boundary_reduction))


def mode_features() -> set:
    """What the enclosing context turns on: the batch-invariant mode
    (``runtime.invariant.batch_invariant``)."""
    return {Feature.BATCH_INVARIANT} if BATCH_INVARIANT.on else set()


def check_invariant(model_cls, features=(), config=None, dims=None) -> None:
    """In the batch-invariant mode, ``model_cls`` (its ``batch_invariant`` declaration) and
    ``features`` against it; nothing outside the mode. A forward or a generation asks it, so a
    model built outside the mode and run inside it is refused too.

    Args:
        model_cls: the model class, or None.
        features: what else the caller turns on (``TBO`` for a two-batch forward, say).
        config, dims: the model's parsed config and ``ParallelDims`` (its layout's rule).
    """
    if BATCH_INVARIANT.on:
        check(Setup(frozenset({Feature.BATCH_INVARIANT, *features}), model_cls, config, dims))


def check_model(model_cls, config, runtime, features=()) -> None:
    """Model ``model_cls`` with ``config`` on ``runtime``, with ``features`` on besides the
    runtime's (an FP8 config turns ``FP8`` on, the enclosing batch-invariant mode
    ``BATCH_INVARIANT``): before anything of the model is built.

    Args:
        model_cls: the model class (its registered capabilities).
        config: its parsed config.
        runtime: the ``BoundaryRuntime`` it is built on.
        features: what else is on (``attach_lora`` adds ``LORA``).
    """
    on = set(runtime_features(runtime)) | set(features) | mode_features()
    if getattr(config, "fp8_block", None):
        on.add(Feature.FP8)
    check(Setup(frozenset(on), model_cls, config, runtime.parallel.dims,
                runtime.boundary_reduction))


__all__ = ["CapabilityError", "Feature", "GRAPH_RULES", "GraphRule", "LAYOUT_RULES",
           "MODEL_RULES", "PAIRS", "PairRule", "Rule", "Setup", "check", "check_invariant",
           "check_model", "check_runtime", "graph_blocker", "mode_features", "pair_rule",
           "refusals", "runtime_features"]
