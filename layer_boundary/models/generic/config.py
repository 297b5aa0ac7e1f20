"""What the Transformers backend reads of a checkpoint: transformers' config for its
``model_type``, the ``base_model_tp_plan`` that says how each linear splits, and the shape of
each decoder layer (which norms it holds decides its residual kind). What it cannot serve is
refused here, by name, before anything is built."""

from __future__ import annotations

import enum
import fnmatch
from dataclasses import dataclass, field

from ..config import CheckpointError
from .meta import refuse



class LayerShape(enum.Enum):
    """How a decoder layer joins its residual, read from the norms it holds."""

    # attention read through its norm, output added; FFN likewise (Llama)
    PRE_NORM = "pre-norm"
    # each sublayer read through its input norm, its output through its own post norm before
    # the add (Gemma 2/3, GLM-4)
    SANDWICH = "sandwich"
    # the residual read as it is, each output through its post norm before the add (OLMo-2)
    POST_NORM = "post-norm"


@dataclass(frozen=True)
class LayerForm:
    """Which of a layer's norms does what: the attention's read and post norm, the FFN's
    read and post norm (None: none), under the names transformers gives them."""

    shape: LayerShape
    attn_read: str | None
    attn_post: str | None
    ffn_read: str | None
    ffn_post: str | None

    @property
    def norms(self) -> tuple:
        return tuple(n for n in (self.attn_read, self.attn_post, self.ffn_read, self.ffn_post)
                     if n is not None)


# the forms served, by the norms a layer holds (each proven per model by the probe)
FORMS = (
    LayerForm(LayerShape.PRE_NORM, "input_layernorm", None, "post_attention_layernorm", None),
    LayerForm(LayerShape.PRE_NORM, "attention_layernorm", None, "feedforward_layernorm", None),
    LayerForm(LayerShape.PRE_NORM, "input_layernorm", None, "pre_feedforward_layernorm", None),
    LayerForm(LayerShape.SANDWICH, "input_layernorm", "post_attention_layernorm",
              "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    LayerForm(LayerShape.SANDWICH, "input_layernorm", "post_self_attn_layernorm",
              "post_attention_layernorm", "post_mlp_layernorm"),
    LayerForm(LayerShape.SANDWICH, "input_layernorm", "post_attention_layernorm",
              "pre_mlp_layernorm", "post_mlp_layernorm"),
    LayerForm(LayerShape.POST_NORM, None, "post_attention_layernorm", None,
              "post_feedforward_layernorm"),
)
COMPUTE = ("self_attn", "mlp")

# tp_plan styles, and what each becomes
COLWISE, ROWWISE = "colwise", "rowwise"
# the output gathered (every rank computes on every head), and the input split to match
# (OLMo-2's q/k norms over the whole projection)
COLWISE_GATHER, ROWWISE_SPLIT = "colwise_gather_output", "rowwise_split_input"
MOE_EXPERTS = "moe_tp_experts"  # stacked experts, their intermediate split over TP
REPLICATED = ("replicated_with_grad_allreduce",)  # the same tensor on every rank


def transformers_config(raw: dict):
    """transformers' config of ``raw`` (a config.json dict), or the refusal naming why not."""
    model_type = raw.get("model_type")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise CheckpointError(f"config.json model_type {model_type!r} has no model file of ours "
                              "and the transformers backend needs transformers: pip install "
                              "'layer_boundary[transformers]'") from None
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise CheckpointError(f"config.json model_type {model_type!r} is unknown to "
                              f"transformers {transformers.__version__} and has no model file "
                              "of ours")
    try:
        config = CONFIG_MAPPING[model_type].from_dict(dict(raw))
    except Exception as exc:  # noqa: BLE001 - transformers' own reader refusing its file
        raise refuse(model_type, f"transformers does not read its config.json back "
                     f"({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    if getattr(config, "quantization_config", None) is not None or "quantization_config" in raw:
        raise refuse(model_type, "a quantized checkpoint (quantization_config)")
    return config


@dataclass(frozen=True, eq=False)
class GenericConfig:
    """A checkpoint as the Transformers backend serves it.

    Args:
        model_type: config.json's.
        hf: transformers' config (its attention implementation set to ours).
        tp_plan: ``base_model_tp_plan``: {module pattern ("layers.*.mlp.down_proj"): style}.
        forms: each decoder layer's ``LayerForm``.
        hidden_size, vocab_size, num_hidden_layers, tie_word_embeddings: as the config says.
        num_attention_heads, num_key_value_heads, head_dim: the attention's shapes.
        embed_scale: what the embedding's output is multiplied by (transformers'
            ``embed_scale`` of a scaled embedding; None: nothing).
        final_logit_softcapping: logits = cap * tanh(logits / cap) (None: none).
    """

    model_type: str
    hf: object = field(repr=False)
    tp_plan: dict
    forms: tuple
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    tie_word_embeddings: bool
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    embed_scale: float | None = None
    final_logit_softcapping: float | None = None

    fields = {}  # config.json fields checked here: none (transformers reads its own)

    @classmethod
    def validate(cls, raw: dict) -> None:
        """transformers validates its own config when it reads it (``from_dict``)."""

    @classmethod
    def from_dict(cls, raw: dict) -> GenericConfig:
        from .meta import skeleton

        hf = transformers_config(raw)
        model_type = raw["model_type"]
        plan = getattr(hf, "base_model_tp_plan", None)
        if not plan:
            raise refuse(model_type, "its config has no base_model_tp_plan (transformers says "
                                     "nothing of how its linears split)")
        model = skeleton(hf)  # on the meta device: no memory
        layers = decoder_layers(model, hf)
        forms = tuple(layer_form(model_type, layer) for layer in layers)
        plan = with_llama_names(dict(plan), layers[0], hf)
        attn = model.model.layers[0].self_attn
        heads = hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        head_dim = getattr(attn, "head_dim", None) or hf.hidden_size // heads
        embed = model.model.embed_tokens
        # a scaled embedding keeps its scale as a float beside the buffer (on the meta device)
        scale = getattr(embed, "scalar_embed_scale", None)
        if scale is None and hasattr(embed, "embed_scale"):
            raise refuse(model_type, f"{type(embed).__name__} scales its output by a buffer "
                         "whose value the meta device does not hold")
        return cls(model_type, hf, plan, forms, hf.hidden_size, hf.vocab_size,
                   hf.num_hidden_layers, bool(getattr(hf, "tie_word_embeddings", False)),
                   heads, kv_heads, int(head_dim),
                   embed_scale=None if scale is None else float(scale),
                   final_logit_softcapping=getattr(hf, "final_logit_softcapping", None))

    @property
    def num_experts(self) -> int:
        """The routed experts of each MoE block, as transformers' config names them (0: a
        dense model): what ``--ep`` splits."""
        for name in ("num_experts", "num_local_experts", "n_routed_experts"):
            value = getattr(self.hf, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return 0

    def style(self, name: str) -> str | None:
        """The tp_plan style of the module ``name`` (relative to the base model:
        ``layers.3.mlp.down_proj``), None where the plan names none. A module nested deeper
        in a stage than the plan names takes the style of its stage's module of the same
        name (Qwen2-MoE's ``mlp.shared_expert.gate_proj`` is split as ``mlp.gate_proj``)."""
        for candidate in (name, _stage_leaf(name)):
            for pattern, style in self.tp_plan.items():
                if candidate and fnmatch.fnmatchcase(candidate, pattern.replace("*", "[0-9]*")):
                    return style
        return None


def _stage_leaf(name: str) -> str | None:
    """``layers.3.mlp.shared_expert.gate_proj`` -> ``layers.3.mlp.gate_proj`` (None where the
    name is no deeper than that)."""
    parts = name.split(".")
    if len(parts) <= 4 or parts[0] != "layers":
        return None
    return ".".join(parts[:3] + parts[-1:])


def decoder_layers(model, hf) -> list:
    """The decoder layers of transformers' model ``model`` (``model.model.layers``), or the
    refusal naming what it holds instead."""
    base = getattr(model, "model", None)
    missing = [name for name in ("embed_tokens", "layers", "norm")
               if base is None or not hasattr(base, name)]
    if missing or not hasattr(model, "lm_head"):
        raise refuse(hf.model_type, f"{type(model).__name__} is not laid out as "
                     "model.embed_tokens, model.layers, model.norm and lm_head (it lacks "
                     f"{', '.join(missing or ['lm_head'])})")
    return list(base.layers)


def layer_form(model_type: str, layer) -> LayerForm:
    """A decoder layer's ``LayerForm``, from the modules it holds: the attention
    (``self_attn``), the FFN (``mlp``) and the norms of exactly one form (dropouts, which do
    nothing in inference, aside)."""
    from torch import nn

    children = {name for name, child in layer.named_children()
                if not isinstance(child, (nn.Dropout, nn.Identity))}
    cls = type(layer).__name__
    missing = [name for name in COMPUTE if name not in children]
    if missing:
        raise refuse(model_type, f"{cls} has no {' or '.join(missing)} (its children: "
                     f"{', '.join(sorted(children))})")
    for form in FORMS:
        if children == set(COMPUTE) | set(form.norms):
            return form
    raise refuse(model_type, f"{cls} holds {', '.join(sorted(children))}: not a pre-norm, "
                 "sandwich or post-norm layer of one attention and one MLP")


# the plan of a Llama layer's linears: what a plan that names none of a stage's takes, where
# the layer's linears of that stage carry these names and nothing in its attention spans
# several heads (``with_llama_names``)
LLAMA_PLAN = {"self_attn": {"q_proj": COLWISE, "k_proj": COLWISE, "v_proj": COLWISE,
                            "o_proj": ROWWISE},
              "mlp": {"gate_proj": COLWISE, "up_proj": COLWISE, "down_proj": ROWWISE}}


def with_llama_names(plan: dict, layer, hf) -> dict:
    """``plan`` with Llama's entries for a stage it names nothing of (HunYuan's config plans
    only its embedding), where that stage's linears are exactly Llama's by name and shape
    (and, in the attention, every other parameter is at most one head wide: a norm over the
    whole projection, OLMo-2's, would need a sum over the heads' ranks). The tp 2 comparisons
    of scripts/transformers_coverage.py hold each type that takes it against world 1."""
    from torch import nn

    head_dim = getattr(layer.self_attn, "head_dim", None)
    for stage, names in LLAMA_PLAN.items():
        if any(pattern.startswith(f"layers.*.{stage}.") for pattern in plan):
            continue
        module = getattr(layer, stage)
        linears = {n for n, m in module.named_modules() if type(m) is nn.Linear}
        if linears != set(names) or any(isinstance(m, nn.Linear) and type(m) is not nn.Linear
                                        for m in module.modules()):
            continue
        if stage == "self_attn" and (head_dim is None or any(
                p.numel() > head_dim for n, p in module.named_parameters()
                if n.split(".")[0] not in names)):
            continue
        plan.update({f"layers.*.{stage}.{n}": style for n, style in names.items()})
    return plan
