"""config.json: reading it, and the one home of the checks its fields get.

A model's config class declares the fields it reads and how each is checked (``fields``, a
dict of field name to one of the validators below, usually built from the shared groups);
``validate`` runs them once, before ``from_dict`` reads anything, so a string, a bool where a
number belongs, a zero count or a list where an object belongs is an error naming the field,
never a silent misread (``"false"`` read as true, ``0`` read as absent). A null counts as
absent where transformers reads None as "none" (a window, a rope dict, a head_dim to derive);
where a model reads a number with a default, transformers would compute with None, so the
null is refused by name (``number``, ``integer``); and a field whose null transformers' config
refuses in every class that has it (``NOT_NULL``) is refused wherever config.json sets one,
whatever the reader would have made of it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar
from collections.abc import Callable


# a missing, malformed or mismatched checkpoint; the message names the file or tensor
from ..runtime.shards import CheckpointError  # noqa: E402  (defined where loaders read)


# the largest config.json read: the public ones are a few KB (a few hundred with a tokenizer's
# tables inlined)
MAX_CONFIG_BYTES = 16 * 2 ** 20


def read_config(path) -> dict:
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} is a file, not a folder (give the "
                              "folder holding config.json)" if path.exists() else
                              f"checkpoint directory {path} does not exist")
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} is missing")
    if cfg_file.stat().st_size > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{cfg_file} holds {cfg_file.stat().st_size:,} bytes; a "
                              f"config.json is at most {MAX_CONFIG_BYTES:,}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {exc}") from None
    except RecursionError:
        raise CheckpointError(f"{cfg_file} nests deeper than a JSON reader follows") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file} does not hold a JSON object")
    return cfg


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Check:
    """One field's check: ``ok(value)``, and what the value must be, for the error."""

    ok: Callable[[object], bool]
    what: str


POSITIVE_INT = Check(lambda v: _is_int(v) and v >= 1, "a positive integer")
NON_NEGATIVE_INT = Check(lambda v: _is_int(v) and v >= 0, "a non-negative integer")
POSITIVE_NUMBER = Check(lambda v: _is_number(v) and math.isfinite(v) and v > 0,
                        "a positive number")
FRACTION = Check(lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]")
FINITE_NUMBER = Check(lambda v: _is_number(v) and math.isfinite(v), "a finite number")
BOOL = Check(lambda v: isinstance(v, bool), "true or false")
INT_LIST = Check(lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
                 "a list of integers")
OBJECT = Check(lambda v: isinstance(v, dict), "an object")
STRING = Check(lambda v: isinstance(v, str), "a string")

# sizes every architecture shares, bounded where a tensor index (int64 elements, int32 in
# kernels) still holds them: beyond, a config is refused by name before any arithmetic
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim")
MAX_SIZE = 2 ** 31 - 1
# the names routed experts go by (their count, then how many a token picks)
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
EXPERTS_PER_TOKEN = ("num_experts_per_tok",)
# the names a norm's epsilon goes by
NORM_EPSILONS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")

# The fields architectures share, checked here the same way for every architecture wherever a
# config.json sets them, whether or not its model reads them: a config class declares only
# its own fields (``fields``), and re-declares a shared one only where its architecture means
# something else by it (``shared_overrides``: Qwen3-Next's ``num_experts`` 0 is a dense model).
SHARED = {
    **dict.fromkeys(SIZES + ("max_position_embeddings", "moe_intermediate_size",
                             "sliding_window"), POSITIVE_INT),
    **dict.fromkeys(EXPERT_COUNTS + EXPERTS_PER_TOKEN + ("n_shared_experts", "n_group",
                                                         "topk_group"), POSITIVE_INT),
    **dict.fromkeys(NORM_EPSILONS, POSITIVE_NUMBER),
    "rope_theta": POSITIVE_NUMBER, "partial_rotary_factor": FRACTION,
    "rope_parameters": OBJECT, "rope_scaling": OBJECT, "quantization_config": OBJECT,
    "tie_word_embeddings": BOOL, "rope_interleave": BOOL,
    **dict.fromkeys(("hidden_act", "hidden_activation", "scoring_func", "topk_method"), STRING),
}
# what a rope dict (rope_parameters / rope_scaling, or one of them per layer type) may say
ROPE_FIELDS = {"rope_theta": POSITIVE_NUMBER, "partial_rotary_factor": FRACTION,
               "factor": POSITIVE_NUMBER}

# Fields whose null transformers' config refuses in every class that has one (its strict
# dataclass types them without None) and that some model here reads with a default: the
# default would stand in for the null silently (Phi-3's rms_norm_eps read as 1e-5, a
# tie_word_embeddings as False, Mixtral's eps, DeepSeek-V4's hc_eps, Inkling's sizes), so a
# null is refused by name wherever config.json sets one. tests/models/test_config_validation.py
# checks each name against transformers for every registered architecture.
NOT_NULL = frozenset({
    "rms_norm_eps", "layer_norm_epsilon", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "use_bias", "use_conv_bias", "use_parallel_residual",
    "use_sliding_window", "intermediate_size", "moe_intermediate_size", "num_experts",
    "n_shared_experts", "routed_scaling_factor", "zero_expert_num", "hc_eps", "swiglu_limit",
    # Inkling's own
    "d_rel", "rel_extent", "log_scaling_alpha", "route_scale", "shared_expert_sink",
    "swa_head_dim", "swa_num_attention_heads", "swa_num_key_value_heads",
})

# groups of fields some architectures read and others do not (the shared ones aside)
DECODER = {"attention_bias": BOOL}
EXPERTS = {"norm_topk_prob": BOOL, "routed_scaling_factor": POSITIVE_NUMBER}
# multi-head latent attention
MLA = {f: POSITIVE_INT for f in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                 "qk_rope_head_dim", "v_head_dim")}


def _check(cfg: dict, field: str, check: Check, where: str = "field ") -> None:
    if cfg.get(field) is not None and not check.ok(cfg[field]):
        raise CheckpointError(f"config.json {where}{field} must be {check.what}, got "
                              f"{cfg[field]!r}")


def validate_shared(cfg: dict, overrides: dict | None = None,
                    not_null: frozenset = frozenset()) -> None:
    """The fields every architecture shares (``SHARED``, less ``overrides``: field -> the
    architecture's own check), checked once for all: each field's type and range, a null
    where transformers refuses one (``NOT_NULL``, and the architecture's ``not_null``), the
    rope dicts' (per layer type too), the size fields' bound, and the attention heads'
    grouping."""
    checks = {**SHARED, **(overrides or {})}
    for field, check in checks.items():
        _check(cfg, field, check)
    for field in sorted(NOT_NULL | not_null):
        if field in cfg and cfg[field] is None:
            raise CheckpointError(f"config.json field {field} is null; transformers reads no "
                                  "null there: give a value, or leave the field out")
    for name in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(name)
        if not isinstance(rope, dict):
            continue
        nested = [(f"{name}.{k}", v) for k, v in rope.items() if isinstance(v, dict)]
        for where, part in nested or [(name, rope)]:
            for field, check in ROPE_FIELDS.items():
                _check(part, field, check, f"{where}.")
    for field in SIZES:
        value = cfg.get(field)
        if _is_int(value) and value > MAX_SIZE:
            raise CheckpointError(f"config.json field {field}={value} is beyond any model "
                                  f"this package runs (at most {MAX_SIZE:,})")
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if _is_int(heads) and _is_int(kv) and heads % kv:
        raise CheckpointError(f"config.json field num_attention_heads={heads} is not a multiple "
                              f"of num_key_value_heads={kv} (each key/value head serves a "
                              "whole group of query heads)")


def validate(cfg: dict, fields: dict, *, experts: tuple = EXPERT_COUNTS,
             top_k: tuple = EXPERTS_PER_TOKEN, extra_experts: str | None = None,
             overrides: dict | None = None, not_null: frozenset = frozenset()) -> None:
    """Check the fields every architecture shares (``validate_shared``), then every declared
    field ``cfg`` sets, and refuse a null in ``not_null`` (the architecture's own fields
    whose null its transformers config refuses, where another architecture's reads None as
    "none"); then that the experts chosen per token fit the experts there are
    (``experts``/``top_k``: the names the architecture may use; ``extra_experts``: a field
    counting experts chosen beside them, LongCat's identity ones)."""
    validate_shared(cfg, overrides, not_null)
    for field, check in fields.items():
        _check(cfg, field, check)
    count = next((cfg[f] for f in experts if cfg.get(f) is not None), None)
    k = next((cfg[f] for f in top_k if cfg.get(f) is not None), None)
    extra = (cfg.get(extra_experts) or 0) if extra_experts else 0
    if count is not None and k is not None and k > count + extra:
        raise CheckpointError(f"config.json field num_experts_per_tok={k} exceeds the "
                              f"{count} experts")


# the dataclass field metadata key of a declared setting (``settings.setting``)
SETTING = "setting"


class _DeclaredChecks:
    """``CheckedConfig.fields`` where a class does not set it: the checks of its declared
    settings (``setting(check=...)``, under each config.json name; a shared field's check is
    ``SHARED``'s) and of ``checks`` (fields its own reader reads)."""

    def __get__(self, instance, owner) -> dict:
        declared = {}
        for f in dataclasses.fields(owner) if dataclasses.is_dataclass(owner) else ():
            spec = f.metadata.get(SETTING)
            if spec is not None and spec.check is not None:
                declared.update(dict.fromkeys(spec.names or (f.name,), spec.check))
        return {**{k: c for k, c in declared.items() if k not in SHARED}, **owner.checks}


class CheckedConfig:
    """What a model's config class declares about config.json: the fields it reads beyond
    the shared ones and the check of each (``fields``: its settings' checks and ``checks``,
    unless it sets ``fields`` itself), a shared field it means differently
    (``shared_overrides``), fields whose null its transformers config refuses where another
    architecture's reads it as "none" (``not_null``: a null kv-head count or head_dim read
    as derived, a null flag as its default, would run a config transformers does not load),
    and the names its experts and experts per token go by (for the check that one fits the
    other).

    A field declared with ``setting()`` is read by ``read`` (``from_dict``) as it says: its
    check, its default, the names config.json gives it, what a null means, said once. A
    reader extends ``read`` for what a setting cannot say (a rope dict, per-layer windows)."""

    fields = _DeclaredChecks()
    checks: ClassVar[dict] = {}
    shared_overrides: ClassVar[dict] = {}
    not_null: ClassVar[frozenset] = frozenset()
    expert_fields: ClassVar[tuple] = EXPERT_COUNTS
    top_k_fields: ClassVar[tuple] = EXPERTS_PER_TOKEN
    extra_expert_field: ClassVar[str | None] = None

    @classmethod
    def validate(cls, raw: dict) -> None:
        validate(raw, cls.fields, experts=cls.expert_fields, top_k=cls.top_k_fields,
                 extra_experts=cls.extra_expert_field, overrides=cls.shared_overrides,
                 not_null=cls.not_null)

    @classmethod
    def from_dict(cls, cfg: dict):
        """The config of a config.json that ``validate`` passed."""
        return cls(**cls.read(cfg))

    @classmethod
    def read(cls, cfg: dict, unread: frozenset = frozenset()) -> dict:
        """The dataclass fields of a config.json: each declared setting, in field order (a
        field derived from others reads those before it), but those in ``unread`` (a field
        the model does not use, left at its dataclass default)."""
        values = {}
        for f in dataclasses.fields(cls):
            if SETTING in f.metadata and f.name not in unread:
                values[f.name] = cls.read_setting(cfg, f.name, values)
        return values

    @classmethod
    def read_setting(cls, cfg: dict, name: str, before: dict):
        """Field ``name``'s declared setting read from ``cfg`` (``before``: the fields read
        before it): a field ``read`` left unread, read where the reader finds it is used."""
        return cls.__dataclass_fields__[name].metadata[SETTING].read(cfg, name, before)

    @classmethod
    def default_of(cls, name: str):
        """Field ``name``'s dataclass default (what a reader falls back on)."""
        return cls.__dataclass_fields__[name].default


def number(cfg: dict, field: str, default: float, where: str = "field ") -> float:
    """``cfg[field]`` (checked already) as a float, ``default`` where config.json leaves it
    out. A null is refused by name: transformers reads it as None, which no model computes
    with (``where``: how the error names the field's place)."""
    if field not in cfg:
        return float(default)
    if cfg[field] is None:
        raise CheckpointError(f"config.json {where}{field} is null: give a number, or leave "
                              f"it out for the default {default}")
    return float(cfg[field])


def integer(cfg: dict, field: str, default: int) -> int:
    """``number``, for a count."""
    return int(number(cfg, field, default))


def theta_of(rope: dict, cfg: dict, default: float) -> float:
    """The rope's theta: its rope dict's, else config.json's top-level one, else
    ``default``."""
    return number(rope, "rope_theta", number(cfg, "rope_theta", default), "rope dict's ")


def require(cfg: dict, field: str, kind=int):
    """A field the architecture cannot do without, of ``kind`` (int: positive)."""
    if field not in cfg or cfg[field] is None:
        raise CheckpointError(f"config.json has no {field}")
    value = cfg[field]
    if kind is int and (not _is_int(value) or value < 1):
        raise CheckpointError(f"config.json field {field} must be a positive integer, got "
                              f"{value!r}")
    if kind is float and not (_is_number(value) and math.isfinite(value)):
        raise CheckpointError(f"config.json field {field} must be a finite number, got "
                              f"{value!r}")
    return value


def required(cfg: dict, *fields: str) -> dict:
    """{field: value} of fields the architecture cannot do without (positive integers)."""
    return {field: require(cfg, field) for field in fields}



def fp8_quantization(cfg: dict) -> tuple[tuple[int, int] | None, tuple[str, ...]]:
    """config.json's ``quantization_config`` as this package loads it: (the weights' block
    [out, in], the modules left unquantized), or (None, ()) for an unquantized checkpoint.
    Block-quantized FP8 with dynamic activations only, as the public FP8 releases store it."""
    q = cfg.get("quantization_config")
    if not q:
        return None, ()
    method = q.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"config.json quantization_config quant_method {method!r} is not "
                              "supported (fp8 only)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise CheckpointError(f"config.json quantization_config activation_scheme {scheme!r} "
                              "is not supported (dynamic only)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"config.json quantization_config fmt {fmt!r} is not supported "
                              "(e4m3 only)")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(_is_int(b) and b > 0 for b in block)):
        raise CheckpointError("config.json quantization_config weight_block_size must be two "
                              f"positive integers [out, in], got {block!r}")
    skip = q.get("modules_to_not_convert") or []
    if not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
        raise CheckpointError("config.json quantization_config modules_to_not_convert must be "
                              f"a list of module names, got {skip!r}")
    return (int(block[0]), int(block[1])), tuple(skip)


def quantized_read(cfg, layer: int, modules: tuple[str, ...]):
    """The read of a stage whose input linears are ``modules`` (names under layer ``layer``):
    the FP8 read, grouped as the weights' input blocks, where the checkpoint quantizes all of
    them; None (the default add+norm read) otherwise. ``modules_to_not_convert`` entries match
    as transformers matches them: as substrings of the module's name."""
    block = getattr(cfg, "fp8_block", None)
    if block is None:
        return None
    names = [f"model.layers.{layer}.{m}" for m in modules]
    if any(s in n for s in cfg.fp8_skip for n in names):
        return None
    from ..residual.quant import QuantizedRead

    return QuantizedRead(block[1])


def default_rope(cfg: dict) -> dict:
    """The rope dict of a config.json (``rope_parameters``, else the legacy ``rope_scaling``;
    empty: neither), refused by name unless its type is the default one."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"config.json rope_type {rope_type!r} is not supported "
                              "(default only)")
    return rope


def check_unquantized_silu(cfg: dict, fp8: bool = False) -> None:
    """Reject a quantized config.json (but an FP8 one where ``fp8``: ``fp8_quantization``
    reads it) or one whose ``hidden_act`` is not silu."""
    if cfg.get("quantization_config") and not fp8:
        raise CheckpointError("config.json quantization_config is not supported (unquantized "
                              "checkpoints only)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"config.json hidden_act {act!r} is not supported (silu only)")


def check_divisible(field: str, value: int, degree: str, size: int, why: str = "") -> None:
    """A config field that must split evenly over a parallel degree (``check_parallel``)."""
    if value % size:
        raise ValueError(f"{field}={value} is not divisible by {degree}={size}{why}")


def check_heads(heads: int, kv_heads: int, attn_tp: int,
                names: tuple = ("num_attention_heads", "num_key_value_heads")) -> None:
    """Query heads split over attention TP; kv heads split, or replicated over whole ranks
    (``names``: the config fields that count them)."""
    if heads % attn_tp:
        raise ValueError(f"{names[0]}={heads} is not divisible by attention tp={attn_tp}")
    if (kv_heads % attn_tp) if kv_heads >= attn_tp else (attn_tp % kv_heads):
        raise ValueError(f"{names[1]}={kv_heads} and attention tp={attn_tp}: one must divide "
                         "the other")


def check_tp(cfg, attn_tp: int, tp: int) -> None:
    """A dense decoder's heads over attention TP (``check_heads``) and its
    ``intermediate_size`` over TP, naming the config field."""
    check_heads(cfg.num_attention_heads, cfg.num_key_value_heads, attn_tp)
    if cfg.intermediate_size % tp:
        raise ValueError(f"intermediate_size={cfg.intermediate_size} is not divisible by tp={tp}")


def check_dense(cfg, dims) -> None:
    """``check_parallel`` of a dense decoder: query and kv heads over attention TP,
    ``intermediate_size`` over TP."""
    check_tp(cfg, dims.attn_tp, dims.tp)


def check_grouped_router(experts: int, n_group: int, topk_group: int, top_k: int,
                         min_group: int = 2) -> None:
    """DeepSeek's group-limited router: experts split into ``n_group`` groups of at least
    ``min_group`` (2 for V3's: a group's score is the sum of its two best; 1 for V2's, which
    scores a group by its best), ``topk_group`` of them kept, enough experts in those for
    ``top_k``."""
    if experts % n_group:
        raise CheckpointError(f"config.json n_routed_experts={experts} is not divisible by "
                              f"n_group={n_group}")
    if experts // n_group < min_group:
        raise CheckpointError(f"config.json n_group={n_group} leaves fewer than 2 experts per "
                              "group (group scores sum each group's top 2)")
    if topk_group > n_group:
        raise CheckpointError(f"config.json topk_group={topk_group} exceeds n_group={n_group}")
    if top_k > topk_group * (experts // n_group):
        raise CheckpointError(f"config.json num_experts_per_tok={top_k} exceeds the experts "
                              f"of topk_group={topk_group} groups")


# transformers' names for a layer's attention in ``layer_types``
SLIDING, FULL = "sliding_attention", "full_attention"
STRING_LIST = Check(lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                    "a list of strings")
SLIDING_FIELDS = {"layer_types": STRING_LIST}  # sliding_window is a shared field


def layer_windows(cfg: dict, layers: int, default=None) -> tuple:
    """Each layer's sliding window (None: it sees every position) from ``layer_types`` and
    ``sliding_window``, checked (validate's field checks have run).

    Args:
        cfg: config.json.
        layers: ``num_hidden_layers``.
        default: ``default(layers)``, the architecture's ``layer_types`` where config.json
            has none (transformers fills it in; a hand-written config may leave it out).
    """
    types = cfg.get("layer_types")
    if types is None:
        if default is None:
            raise CheckpointError("config.json has no layer_types")
        types = default(layers)
    if len(types) != layers:
        raise CheckpointError(f"config.json layer_types must list num_hidden_layers={layers} "
                              f"entries, got {len(types)}")
    bad = sorted(set(types) - {SLIDING, FULL})
    if bad:
        raise CheckpointError(f"config.json layer_types {bad} are not supported (only "
                              f"{SLIDING}, {FULL})")
    window = cfg.get("sliding_window")
    if SLIDING in types and window is None:
        raise CheckpointError(f"config.json layer_types has {SLIDING} layers but no "
                              "sliding_window")
    return tuple(window if t == SLIDING else None for t in types)
