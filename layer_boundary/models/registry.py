"""Which model class serves a checkpoint's ``model_type``, and which policy its
``architectures`` get: each model file registers its own.

A model declares itself in its own file, on its class, with ``@register_model``:

    @register_model("llama", LlamaConfig,     # config.json's model_type, and its config:
                    architectures=("LlamaForCausalLM",),  # config.json's, for auto's lookup
                    boundary_reduction="rs+rsv",   # what ``auto`` resolves to
                    positional_cache=True,         # a draft may use it
                    check_parallel=check_parallel, # a topology its config cannot shard over
                    context_parallel=True,         # its attention runs on a CP share
                    sequence_parallel=True,        # its compute honours a scattered scope
                    attn_input_scattered="...",    # why not: no qkv latent (MLA only)
                    moe_a2a="...",                 # why not: no MoE layers
                    batch_invariant=True)          # its logits hold under --batch-invariant
    class LlamaForCausalLM(CausalLM):
        layer_cls = LlamaDecoderLayer

(those are a dense decoder's: ``llama.py`` says them as ``**dense()``, ``DENSE``, and a model
built like it names what differs, ``**dense(moe_a2a=True, ...)``).

The command line, the runner, the loader and the draft checks read these facts here; none
of them names an architecture. The registry fills itself by importing every module of this
package once, on first use, so a new model file is found without being listed anywhere.
"""

from __future__ import annotations

import importlib
import pkgutil

from .config import CheckpointError, check_dense

_MODELS: dict[str, type] = {}
# the Hugging Face ``architectures`` entries a model declares, each naming the class whose
# ``boundary_reduction`` ``auto`` takes for a checkpoint listing it
_ARCHITECTURES: dict[str, type] = {}
_DISCOVERED = False


# what every model declares when it registers (no default: each says it, none inherits it)
CAPABILITIES = ("boundary_reduction", "positional_cache", "check_parallel", "context_parallel",
                "sequence_parallel", "attn_input_scattered", "moe_a2a", "batch_invariant")
# the capabilities that are True or the reason the model refuses the feature
SUPPORT = ("context_parallel", "sequence_parallel", "attn_input_scattered", "moe_a2a",
           "batch_invariant")
# reasons several models give, stated once
NO_QKV_LATENT = "its attention has no qkv latent to run before the gather (MLA only)"
NO_MOE_LAYERS = "it has no MoE layers to dispatch"
# What a dense decoder built on the shared layers (GQA and a gated MLP: Llama's) declares:
# ``auto`` picks rs or rsv per batch, its cache is positional (a draft may use it), its
# attention runs on a CP share, its linears move a sequence-parallel batch's rows, it splits
# heads and ``intermediate_size`` (``config.check_dense``); it has no qkv latent and no MoE
# layers. A model built so registers with ``**dense(...)``, naming what differs.
DENSE = {"boundary_reduction": "rs+rsv", "positional_cache": True, "check_parallel": check_dense,
         "context_parallel": True, "sequence_parallel": True,
         "attn_input_scattered": NO_QKV_LATENT, "moe_a2a": NO_MOE_LAYERS,
         "batch_invariant": True}


def dense(**differs) -> dict:
    """The capabilities ``register_model`` takes, as a dense decoder declares them
    (``DENSE``), with what this model declares otherwise (``differs``: capability -> its
    value, e.g. ``moe_a2a=True`` and its own ``check_parallel`` for a MoE)."""
    unknown = sorted(set(differs) - set(CAPABILITIES))
    if unknown:
        raise TypeError(f"dense(): unknown capabilities {unknown}")
    return {**DENSE, **differs}


# batch invariance under attention DP (CausalLM.batch_invariant_dp)
PARALLEL_BLOCK_DP = ("its parallel block adds each DP rank's attention output into that rank's "
                     "rows of the FFN's sum over TP, so where a request's attention output "
                     "enters the sum, and its last bits, follow the DP rank a batch puts it on")


def register_model(model_type: str, config_class: type, *, architectures: tuple = (),
                   **capabilities):
    """Class decorator: the class serves checkpoints whose config.json has ``model_type``.

    Args:
        model_type: config.json's ``model_type``.
        config_class: its config (``validate(raw)``, ``from_dict(raw)``, ``fields``).
        architectures: config.json ``architectures`` entries whose ``auto`` policy is this
            class's ``boundary_reduction`` (``auto_policy``: they come first, then
            ``model_type``, then a nested ``text_config``'s).
        boundary_reduction: what ``--boundary-reduction auto`` resolves to.
        positional_cache: whether a draft may use its cache (a rejected token is overwritten,
            never folded into a state).
        check_parallel: ``check_parallel(cfg, dims)`` rejects a topology the config cannot be
            sharded over, naming the config field.
        context_parallel: True where its attention computes on a CP share (``cp_view``), or
            why it cannot (the refusal ``--cp`` gets).
        sequence_parallel: True where its stages declare sequence-parallel compute (their
            linears gather and reduce-scatter scattered rows), or why not (``--sequence-parallel``).
        attn_input_scattered: True where its attention has a ``qkv_latent_func`` that may
            run before the input gather (MLA), or why not (``--attn-input-scattered``).
        moe_a2a: True where its MoE layers dispatch their routed tokens with an all-to-all
            when the runtime asks (``moe_a2a_backend="all_to_all"``: ``FusedMoE(dispatch=)``,
            ``declare_ffn(dispatches=)``, shared experts replicated), or why not
            (``--moe-a2a-backend``).
        batch_invariant: True where, in the batch-invariant mode (``runtime.invariant``), a
            request's logits are the same bits alone as in any batch (the mode runs the ops
            whose kernels follow the batch a row at a time, whoever calls them; a model's own
            algorithm that follows the batch switches on ``BATCH_INVARIANT.on``), or why it
            cannot (``--batch-invariant`` is refused).
    """
    _check_capabilities(model_type, capabilities)

    def register(cls: type) -> type:
        known = _MODELS.get(model_type)
        if known is not None and known is not cls:
            raise TypeError(f"model_type {model_type!r} is served by {known.__name__} already")
        for name in architectures:
            other = _ARCHITECTURES.get(name)
            if other is not None and other is not cls:
                raise TypeError(f"architecture {name!r} is declared by {other.__name__} already")
        cls.model_type, cls.config_class = model_type, config_class
        cls.architectures = tuple(architectures)
        _ARCHITECTURES.update(dict.fromkeys(architectures, cls))
        _set_capabilities(cls, capabilities)
        _MODELS[model_type] = cls
        return cls

    return register


def _check_capabilities(model_type: str, capabilities: dict) -> None:
    missing = [c for c in CAPABILITIES if c not in capabilities]
    for name in SUPPORT:
        support = capabilities.get(name)
        if support is not None and support is not True and not (isinstance(support, str)
                                                                and support):
            raise TypeError(f"register_model({model_type!r}): {name} is True or the reason "
                            "the model cannot run it")
    unknown = sorted(set(capabilities) - set(CAPABILITIES))
    if missing or unknown:
        raise TypeError(f"register_model({model_type!r}) must declare {list(CAPABILITIES)}"
                        + (f"; unknown {unknown}" if unknown else ""))


def _set_capabilities(cls: type, capabilities: dict) -> None:
    for name, value in capabilities.items():
        setattr(cls, name, staticmethod(value) if callable(value) else value)
    for name in SUPPORT:  # None where supported, else the reason
        value = capabilities[name]
        setattr(cls, f"{name}_refusal", None if value is True else value)


def declare_capabilities(**capabilities):
    """Class decorator: what ``register_model`` declares, for a class that serves no
    ``model_type`` of its own (the Transformers backend's, which serves many)."""
    _check_capabilities("(unregistered)", capabilities)

    def declare(cls: type) -> type:
        _set_capabilities(cls, capabilities)
        return cls

    return declare


def _discover() -> None:
    global _DISCOVERED
    if _DISCOVERED:
        return
    for info in pkgutil.iter_modules(_package_path()):
        importlib.import_module(f"{__package__}.{info.name}")
    _DISCOVERED = True


def _package_path():
    return importlib.import_module(__package__).__path__


def model_types() -> list[str]:
    """Every registered ``model_type``, sorted."""
    _discover()
    return sorted(_MODELS)


def model_class(model_type) -> type:
    """The class serving ``model_type``, or the checkpoint error naming the supported ones."""
    _discover()
    cls = _MODELS.get(model_type)
    if cls is None:
        raise CheckpointError(f"config.json model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(sorted(_MODELS))})")
    return cls


def auto_policy(raw: dict) -> tuple[str, str]:
    """What ``--boundary-reduction auto`` resolves to for a checkpoint's config.json, and
    what decided it: the first ``architectures`` entry a model declares, else the class
    serving its ``model_type``, else the one serving a nested ``text_config``'s.

    Args:
        raw: the checkpoint's config.json.

    Returns (policy, source), e.g. ("rs+rsv", "architectures: Qwen3NextForCausalLM").
    """
    _discover()
    for name in raw.get("architectures") or ():
        cls = _ARCHITECTURES.get(name)
        if cls is not None:
            return cls.boundary_reduction, f"architectures: {name}"
    model_type = raw.get("model_type")
    if model_type in _MODELS:
        return _MODELS[model_type].boundary_reduction, f"model_type: {model_type}"
    text = raw.get("text_config")
    text_type = text.get("model_type") if isinstance(text, dict) else None
    if text_type in _MODELS:
        return _MODELS[text_type].boundary_reduction, f"text_config.model_type: {text_type}"
    model_class(model_type)  # the checkpoint error naming the supported types
    raise AssertionError("unreachable")  # pragma: no cover
