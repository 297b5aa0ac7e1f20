"""DeepSeek-V4's config.json: the fields ``DeepseekV4Config`` reads and checks (only
``sliding_attention`` layers; the compressed layer types are rejected here), and the
topologies it cannot be sharded over. The model is ``deepseek_v4.py``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import (BOOL, DECODER, POSITIVE_INT, POSITIVE_NUMBER, CheckedConfig,
                     CheckpointError, check_divisible, check_unquantized_silu)
from .settings import setting

SLIDING = "sliding_attention"
LAYER_TYPES = (SLIDING, "compressed_sparse_attention", "heavily_compressed_attention")
MLP_TYPES = ("hash_moe", "moe")
# transformers' defaults (DeepseekV4Config) for fields a config.json may leave out
DEFAULT_ROPE_FACTOR = 64 / 512  # qk_rope_head_dim / head_dim
DEFAULT_HASH_LAYERS = 3
SCORING = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid}


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
    """The decoder's sizes, the attention's (grouped low-rank output, one shared K=V head,
    the sliding window, the main rope), each layer's attention and MoE kind, the experts',
    the hyper-connections' and the clamped SwiGLU's, with transformers' defaults."""

    vocab_size: int = setting()
    hidden_size: int = setting()
    moe_intermediate_size: int = setting()
    num_hidden_layers: int = setting()
    num_attention_heads: int = setting()
    head_dim: int = setting()
    q_lora_rank: int = setting(check=POSITIVE_INT)
    o_groups: int = setting(check=POSITIVE_INT)
    o_lora_rank: int = setting(check=POSITIVE_INT)
    n_routed_experts: int = setting()
    num_experts_per_tok: int = setting()
    sliding_window: int = setting()
    layer_types: tuple = ()
    mlp_layer_types: tuple = ()
    rope_head_dim: int = 0
    rope_theta: float = 10000.0
    hc_mult: int = setting(4, POSITIVE_INT)
    hc_sinkhorn_iters: int = setting(20, POSITIVE_INT)
    hc_eps: float = setting(1e-6, POSITIVE_NUMBER)
    swiglu_limit: float = setting(10.0, POSITIVE_NUMBER)
    routed_scaling_factor: float = setting(1.5, POSITIVE_NUMBER)
    scoring_func: str = setting("sqrtsoftplus")
    rms_norm_eps: float = setting(1e-6)
    tie_word_embeddings: bool = setting(False)
    model_type: str = "deepseek_v4"

    checks = {**DECODER, "norm_topk_prob": BOOL, "mlp_bias": BOOL}
    expert_fields, top_k_fields = ("n_routed_experts",), ("num_experts_per_tok",)

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    def is_hash(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "hash_moe"

    @classmethod
    def read(cls, cfg: dict) -> dict:
        """What the model does not compute refused by name (a quantized checkpoint, an
        activation, a router's scoring, MLP biases, kv heads, shared experts), then the
        declared settings, their agreement (the output groups, the experts a token picks),
        the main rope and each layer's attention and MoE kind."""
        check_unquantized_silu(cfg)
        scoring = cfg.get("scoring_func", cls.default_of("scoring_func"))
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
        values = super().read(cfg)
        heads, o_groups = values["num_attention_heads"], values["o_groups"]
        if heads % o_groups:
            raise CheckpointError(f"config.json o_groups={o_groups} does not divide "
                                  f"num_attention_heads={heads}")
        experts, top_k = values["n_routed_experts"], values["num_experts_per_tok"]
        if top_k > experts:
            raise CheckpointError(f"config.json num_experts_per_tok={top_k} exceeds "
                                  f"n_routed_experts={experts}")
        theta, rope_dim = _main_rope(cfg, values["head_dim"])
        layers = values["num_hidden_layers"]
        return dict(values, layer_types=_layer_types(cfg, layers),
                    mlp_layer_types=_mlp_types(cfg, layers), rope_head_dim=rope_dim,
                    rope_theta=theta)


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
