"""OLMo-3 with layer boundaries: OLMo-2 (``olmo2.py``: post norms as residual updates, q/k
norms over every head) with sliding-window layers.

``layer_types`` names each layer's attention (transformers' default: every fourth layer full,
the others sliding); a sliding layer sees its last ``sliding_window`` positions, itself
included, on the positional KV cache (the mask hides the older ones). Each attention type has
its rope (``rope_parameters`` keyed by layer type: default, llama3 or yarn here, other types
refused by name), read as transformers reads it (``layer_type_ropes``): the public OLMo-3
checkpoints' legacy ``rope_scaling`` (YaRN) scales the full layers' rope only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import (BOOL, FULL, POSITIVE_INT, POSITIVE_NUMBER, SLIDING, SLIDING_FIELDS,
                     CheckpointError, layer_windows)
from .llama import LlamaConfig, read_rope
from .olmo2 import AUTO, Olmo2Config, Olmo2ForCausalLM
from .registry import dense, register_model
from .rope import YarnRope, inverse_frequencies


def default_layer_types(layers: int) -> list:
    """transformers' OLMo-3 schedule: every fourth layer full."""
    return [FULL if (i + 1) % 4 == 0 else SLIDING for i in range(layers)]


# transformers' Olmo3Config.default_theta
DEFAULT_THETA = 500000.0


def layer_type_ropes(cfg: dict, used: set) -> dict:
    """{layer type: its rope dict} as transformers 5.24's ``Olmo3Config`` reads config.json
    (``convert_rope_params_to_dict``), for the layer types ``used``:

    * ``rope_parameters`` keyed by layer type (absent or null: a default rope per type);
    * a legacy ``rope_scaling`` updates the full layers' dict (only theirs);
    * a type without a dict gets a default one; a dict without ``rope_theta`` gets the
      top-level ``rope_theta`` (else 500000) on the full layers but always 500000 on the
      sliding ones (transformers pops the top-level theta for the full layers first).

    Keys of ``rope_parameters`` that name no layer type transformers ignores: beside a layer
    type that has no dict of its own, they are refused by name (their rope is not the one
    that runs)."""
    given = cfg.get("rope_parameters")
    per_type = dict(given) if given is not None else {SLIDING: None, FULL: None}
    for kind in (SLIDING, FULL):
        if per_type.get(kind) is not None and not isinstance(per_type[kind], dict):
            raise CheckpointError(f"config.json rope_parameters.{kind} must be an object, got "
                                  f"{per_type[kind]!r}")
    flat = sorted(k for k in per_type if k not in (SLIDING, FULL))
    missing = [kind for kind in sorted(used) if per_type.get(kind) is None]
    if flat and missing:
        raise CheckpointError(f"config.json rope_parameters has no {missing[0]} dict beside "
                              f"its keys {flat}: transformers reads olmo3's rope per layer type "
                              "and ignores those keys (key it by layer type)")
    scaling = cfg.get("rope_scaling")
    if scaling is not None:
        if given is not None and per_type.get(FULL) is None:
            raise CheckpointError("config.json rope_scaling beside a rope_parameters without a "
                                  f"{FULL} dict is not supported (transformers fails on it)")
        per_type[FULL] = {**(per_type.get(FULL) or {"rope_type": "default"}), **scaling}
    thetas = {FULL: cfg.get("rope_theta", DEFAULT_THETA), SLIDING: DEFAULT_THETA}
    return {kind: {"rope_theta": thetas[kind], **(per_type.get(kind) or {"rope_type": "default"})}
            for kind in used}


ROPE_TYPES = ("default", "llama3", "yarn")


def _yarn_number(rope: dict, key: str, check=POSITIVE_NUMBER, required=False):
    """A number of a yarn rope dict, checked (None: absent, where it may be)."""
    value = rope.get(key)
    if value is None and required:
        raise CheckpointError(f"config.json rope_parameters has no {key} (rope_type yarn needs "
                              "it)")
    if value is not None and not check.ok(value):
        raise CheckpointError(f"config.json rope_parameters.{key} must be {check.what}, got "
                              f"{value!r}")
    return value


def read_yarn(rope: dict, cfg: dict, truncate: bool) -> YarnRope:
    """YaRN's parameters from a layer type's rope dict, as transformers'
    ``_compute_yarn_parameters`` reads them (``truncate``: rope_parameters' top-level one,
    the only one transformers reads)."""
    if rope.get("truncate", truncate) != truncate:
        raise CheckpointError(f"config.json rope_parameters truncate={rope['truncate']!r} "
                              "of a layer type is not supported (transformers reads the "
                              "top-level one only)")
    # transformers' standardization: the per-type dict's original context, else
    # max_position_embeddings (a top-level original_max_position_embeddings is ignored)
    context = {"original_max_position_embeddings": rope.get(
        "original_max_position_embeddings", cfg.get("max_position_embeddings"))}
    return YarnRope(float(_yarn_number(rope, "factor", required=True)),
                    _yarn_number(context, "original_max_position_embeddings", POSITIVE_INT,
                                 True),
                    float(_yarn_number(rope, "beta_fast") or 32),  # transformers' ``or``
                    float(_yarn_number(rope, "beta_slow") or 1), truncate,
                    *(_yarn_number(rope, k) for k in ("attention_factor", "mscale",
                                                      "mscale_all_dim")))


def read_layer_rope(rope: dict, cfg: dict, truncate: bool) -> tuple:
    """(rope_theta, llama3 or yarn scaling or None) of a layer type's rope dict."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"config.json rope_type {rope_type!r} is not supported "
                              f"({', '.join(ROPE_TYPES)} only)")
    # the per-type dict alone sets llama3's original context (transformers' nested rope
    # reading never looks at a top-level original_max_position_embeddings)
    base = {k: v for k, v in cfg.items() if k != "original_max_position_embeddings"}
    plain = {**rope, "rope_type": "default"} if rope_type == "yarn" else rope
    theta, scaling = read_rope(base, rope=plain)
    return theta, read_yarn(rope, cfg, truncate) if rope_type == "yarn" else scaling


@dataclass(frozen=True)
class Olmo3Config(Olmo2Config):
    windows: tuple = ()  # each layer's sliding window (None: full)
    ropes: tuple = ()  # each layer's (rope_theta, llama3 or yarn scaling or None)
    model_type: str = "olmo3"

    checks = {**LlamaConfig.checks, **SLIDING_FIELDS}

    @classmethod
    def read_rope_fields(cls, cfg: dict, values: dict) -> dict:
        """Each layer's window and rope (``windows``, ``ropes``); ``rope_theta``: the last
        layer's."""
        windows = layer_windows(cfg, values["num_hidden_layers"], default_layer_types)
        kinds = [SLIDING if w is not None else FULL for w in windows]
        per_type = layer_type_ropes(cfg, set(kinds))
        # transformers' yarn reads ``truncate`` from rope_parameters' top level only
        truncate = (cfg.get("rope_parameters") or {}).get("truncate", True)
        if not BOOL.ok(truncate):
            raise CheckpointError(f"config.json rope_parameters.truncate must be {BOOL.what}, "
                                  f"got {truncate!r}")
        ropes = {kind: read_layer_rope(rope, cfg, truncate) for kind, rope in per_type.items()}
        return {"rope_theta": ropes[kinds[-1]][0], "windows": windows,
                "ropes": tuple(ropes[kind] for kind in kinds)}

    def window(self, index: int) -> int | None:
        return self.windows[index]

    def layer_rotary(self, index: int) -> tuple[torch.Tensor, float]:
        theta, scaling = self.ropes[index]
        if isinstance(scaling, YarnRope):
            return scaling.frequencies(theta, self.head_dim)
        inv_freq = inverse_frequencies(theta, self.head_dim)
        return inv_freq if scaling is None else scaling.scale(inv_freq), 1.0


@register_model("olmo3", Olmo3Config, architectures=("Olmo3ForCausalLM",),
                **dense(boundary_reduction=AUTO))  # AUTO: measured in olmo2.py
class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo-3: OLMo-2's model, its layers sliding or full by ``layer_types``."""
