"""DeepSeek-V4's config.json: the fields ``DeepseekV4Config`` reads and checks (only
``sliding_attention`` layers; the compressed layer types are rejected here), and the
topologies it cannot be sharded over. The model is ``deepseek_v4.py``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import (BOOL, DECODER, EXPERTS, POSITIVE_INT, CheckedConfig, CheckpointError,
                     check_divisible, check_unquantized_silu, require, required)

SLIDING = "sliding_attention"
LAYER_TYPES = (SLIDING, "compressed_sparse_attention", "heavily_compressed_attention")
MLP_TYPES = ("hash_moe", "moe")
# transformers' defaults (DeepseekV4Config) for fields a config.json may leave out
DEFAULT_ROPE_FACTOR = 64 / 512  # qk_rope_head_dim / head_dim
DEFAULT_HASH_LAYERS = 3
SCORING = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid}


def _number(cfg: dict, field: str, default: float, positive: bool = True) -> float:
    value = cfg.get(field, default)
    if value is None:
        value = default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or (positive and value <= 0):
        raise CheckpointError(f"config.json field {field} must be a "
                              f"{'positive ' if positive else ''}number, got {value!r}")
    return float(value)


def _layer_types(cfg: dict, layers: int) -> tuple[str, ...]:
    """Per-layer attention types: ``layer_types``, else the legacy ``compress_ratios`` (0:
    sliding), else transformers' default (compressed layers, which are rejected)."""
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        ratios = {0: SLIDING, 4: LAYER_TYPES[1], 128: LAYER_TYPES[2]}
        types = [ratios.get(r, f"compress ratio {r}") for r in cfg["compress_ratios"]]
    if types is None:
        raise CheckpointError("config.json has no layer_types (transformers' default schedule "
                              "is compressed attention; only sliding_attention layers are "
                              "supported)")
    if not isinstance(types, list) or len(types) < layers:
        raise CheckpointError(f"config.json layer_types must list num_hidden_layers={layers} "
                              f"attention types, got {types!r}")
    types = tuple(types[:layers])  # transformers keeps the first num_hidden_layers
    bad = sorted({t for t in types if t != SLIDING})
    if bad:
        raise CheckpointError(f"config.json layer_types {bad} are not supported (only "
                              "sliding_attention: the compressor and indexer of compressed "
                              "attention are not implemented)")
    return types


def _mlp_types(cfg: dict, layers: int) -> tuple[str, ...]:
    types = cfg.get("mlp_layer_types")
    if types is None:
        hashed = cfg.get("num_hash_layers")
        hashed = DEFAULT_HASH_LAYERS if hashed is None else hashed
        types = ["hash_moe"] * min(layers, hashed) + ["moe"] * max(0, layers - hashed)
    if not isinstance(types, list) or len(types) < layers:
        raise CheckpointError(f"config.json mlp_layer_types must list num_hidden_layers="
                              f"{layers} MoE types, got {types!r}")
    types = tuple(types[:layers])
    bad = sorted({t for t in types if t not in MLP_TYPES})
    if bad:
        raise CheckpointError(f"config.json mlp_layer_types {bad} are not supported "
                              f"(supported: {', '.join(MLP_TYPES)})")
    return types


def _main_rope(cfg: dict, head_dim: int) -> tuple[float, int]:
    """(rope_theta, rope channels) of the sliding layers' ("main") rotary embedding.

    transformers nests ``rope_parameters`` as ``{"main": ..., "compress": ...}``; a flat dict
    (or legacy ``rope_scaling``, such as yarn) applies to the compressed layers only, so the
    main rope is then the default one with the top-level ``rope_theta``.
    """
    rope = cfg.get("rope_parameters") or {}
    main = rope.get("main") if isinstance(rope.get("main"), dict) else {}
    kind = main.get("rope_type", main.get("type", "default"))
    if kind != "default":
        raise CheckpointError(f"config.json rope_parameters.main.rope_type {kind!r} is not "
                              "supported (default only)")
    theta = main.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = main.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if factor is None:
        legacy = cfg.get("qk_rope_head_dim")
        factor = legacy / head_dim if legacy is not None else DEFAULT_ROPE_FACTOR
    rope_dim = int(head_dim * factor)
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise CheckpointError(f"config.json partial_rotary_factor={factor} gives {rope_dim} "
                              f"rope channels of head_dim={head_dim} (must be even, 2..head_dim)")
    return float(theta), rope_dim


@dataclass(frozen=True)
class DeepseekV4Config(CheckedConfig):
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    num_experts_per_tok: int
    sliding_window: int
    layer_types: tuple
    mlp_layer_types: tuple
    rope_head_dim: int
    rope_theta: float = 10000.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    routed_scaling_factor: float = 1.5
    scoring_func: str = "sqrtsoftplus"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    model_type: str = "deepseek_v4"

    fields = {**DECODER, **EXPERTS, "mlp_bias": BOOL,
              **{f: POSITIVE_INT for f in ("hc_mult", "hc_sinkhorn_iters", "o_groups",
                                           "o_lora_rank", "q_lora_rank")}}
    expert_fields, top_k_fields = ("n_routed_experts",), ("num_experts_per_tok",)

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    def is_hash(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "hash_moe"

    @classmethod
    def from_dict(cls, cfg: dict) -> DeepseekV4Config:
        check_unquantized_silu(cfg)
        scoring = cfg.get("scoring_func", "sqrtsoftplus")
        if scoring not in SCORING:
            raise CheckpointError(f"config.json scoring_func {scoring!r} is not supported "
                                  f"(supported: {', '.join(SCORING)})")
        if cfg.get("mlp_bias"):
            raise CheckpointError("config.json mlp_bias true is not supported (bias-free "
                                  "shared expert only)")
        kv_heads = cfg.get("num_key_value_heads", 1)
        if kv_heads != 1:
            raise CheckpointError(f"config.json num_key_value_heads={kv_heads} is not supported "
                                  "(DeepSeek-V4 attention has one shared K=V head)")
        shared = cfg.get("n_shared_experts", 1)
        if shared != 1:
            # transformers builds one shared expert of moe_intermediate_size whatever this says
            raise CheckpointError(f"config.json n_shared_experts={shared} is not supported "
                                  "(one shared expert)")
        layers = require(cfg, "num_hidden_layers")
        heads, head_dim = require(cfg, "num_attention_heads"), require(cfg, "head_dim")
        o_groups = require(cfg, "o_groups")
        if heads % o_groups:
            raise CheckpointError(f"config.json o_groups={o_groups} does not divide "
                                  f"num_attention_heads={heads}")
        experts, top_k = require(cfg, "n_routed_experts"), require(cfg, "num_experts_per_tok")
        if top_k > experts:
            raise CheckpointError(f"config.json num_experts_per_tok={top_k} exceeds "
                                  f"n_routed_experts={experts}")
        theta, rope_dim = _main_rope(cfg, head_dim)
        return cls(
            **required(cfg, "vocab_size", "hidden_size", "moe_intermediate_size",
                       "q_lora_rank", "o_lora_rank", "sliding_window"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            head_dim=head_dim,
            o_groups=o_groups,
            n_routed_experts=experts,
            num_experts_per_tok=top_k,
            layer_types=_layer_types(cfg, layers),
            mlp_layer_types=_mlp_types(cfg, layers),
            rope_head_dim=rope_dim,
            rope_theta=theta,
            hc_mult=require(cfg, "hc_mult") if "hc_mult" in cfg else 4,
            hc_sinkhorn_iters=(require(cfg, "hc_sinkhorn_iters") if "hc_sinkhorn_iters" in cfg
                               else 20),
            hc_eps=_number(cfg, "hc_eps", 1e-6),
            swiglu_limit=_number(cfg, "swiglu_limit", 10.0),
            routed_scaling_factor=_number(cfg, "routed_scaling_factor", 1.5),
            scoring_func=scoring,
            rms_norm_eps=_number(cfg, "rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


def check_parallel(cfg: DeepseekV4Config, dims) -> None:
    """Reject a topology this config cannot be sharded over, naming the config field."""
    check_divisible("num_attention_heads", cfg.num_attention_heads, "attention tp", dims.attn_tp)
    check_divisible("o_groups", cfg.o_groups, "attention tp", dims.attn_tp,
                    " (each rank projects the groups of its own heads)")
    check_divisible("n_routed_experts", cfg.n_routed_experts, "moe_ep", dims.moe_ep)
    check_divisible("moe_intermediate_size", cfg.moe_intermediate_size, "moe_tp", dims.moe_tp)
    if cfg.moe_intermediate_size % dims.tp:
        raise ValueError(f"moe_intermediate_size={cfg.moe_intermediate_size} (shared expert) is "
                         f"not divisible by tp={dims.tp}")
