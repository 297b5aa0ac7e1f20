"""Qwen3 (dense) with layer boundaries. Compute is plain PyTorch; parameter names follow the
Hugging Face checkpoint (q/k/v are stacked into ``qkv_proj`` at load time)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn

from .. import declare_attn, declare_ffn, make_stages
from ..runtime.args import BoundaryRuntime
from ..runtime.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ..runtime.norm import RMSNorm
from .base import CausalLM
from .kv_cache import KVCache, cached_attention
from .rope import apply_rope, inverse_frequencies, rope_cos_sin
from .config import DECODER, CheckedConfig, CheckpointError, require
from .registry import register_model


@dataclass(frozen=True)
class Qwen3Config(CheckedConfig):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "qwen3"

    fields = DECODER

    @classmethod
    def from_dict(cls, cfg: dict) -> "Qwen3Config":
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise CheckpointError(f"config.json rope_type {rope_type!r} is not supported (default only)")
        if cfg.get("use_sliding_window"):
            raise CheckpointError("config.json use_sliding_window=true is not supported")
        heads = require(cfg, "num_attention_heads")
        return cls(
            vocab_size=require(cfg, "vocab_size"),
            hidden_size=require(cfg, "hidden_size"),
            intermediate_size=require(cfg, "intermediate_size"),
            num_hidden_layers=require(cfg, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or require(cfg, "hidden_size") // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )


def check_parallel(cfg: Qwen3Config, dims) -> None:
    check_tp(cfg, dims.attn_tp, dims.tp)


def check_heads(heads: int, kv_heads: int, attn_tp: int) -> None:
    """Query heads split over attention TP; kv heads split, or replicated over whole ranks."""
    if heads % attn_tp:
        raise ValueError(f"num_attention_heads={heads} is not divisible by attention "
                         f"tp={attn_tp}")
    if (kv_heads % attn_tp) if kv_heads >= attn_tp else (attn_tp % kv_heads):
        raise ValueError(f"num_key_value_heads={kv_heads} and attention tp={attn_tp}: one must "
                         "divide the other")


def check_tp(cfg: Qwen3Config, attn_tp: int, tp: int) -> None:
    """Reject a topology this config cannot be sharded over, naming the config field."""
    check_heads(cfg.num_attention_heads, cfg.num_key_value_heads, attn_tp)
    if cfg.intermediate_size % tp:
        raise ValueError(f"intermediate_size={cfg.intermediate_size} is not divisible by tp={tp}")


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, layer_id: int, runtime: BoundaryRuntime, dtype):
        super().__init__()
        group = runtime.parallel.attn_tp
        self.layer_id, self.head_dim = layer_id, cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, group,
                                          bias=cfg.attention_bias, dtype=dtype)
        # PARTIAL output contract: o_proj never reduces; the boundary owns the attn_tp sum.
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        group, bias=cfg.attention_bias, reduce_results=False,
                                        dtype=dtype, name="o_proj")
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.register_buffer("inv_freq", inverse_frequencies(cfg.rope_theta, cfg.head_dim),
                             persistent=False)
        self.scaling = cfg.head_dim ** -0.5

    def forward(self, positions, hidden_states, forward_batch):
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.view(q.shape[0], -1, self.head_dim))  # [T, H, D]
        k = self.k_norm(k.view(k.shape[0], -1, self.head_dim))  # [T, KVH, D]
        v = v.view(v.shape[0], -1, self.head_dim)
        cos, sin = rope_cos_sin(positions, self.inv_freq, q.dtype)
        q = apply_rope(q, cos, sin, interleave=False)
        k = apply_rope(k, cos, sin, interleave=False)
        out = cached_attention(self.layer_id, q, k, v, forward_batch, self.scaling)
        return self.o_proj(out.flatten(1))  # [T, H*D] -> [T, hidden] partial sum


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config, runtime: BoundaryRuntime, dtype):
        super().__init__()
        group = runtime.parallel.tp
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, group,
                                              dtype=dtype, name="gate_proj")
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, group,
                                            dtype=dtype, name="up_proj")
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, group,
                                           dtype=dtype, name="down_proj")

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, layer_id, runtime, dtype)
        self.mlp = self.make_mlp(cfg, layer_id, runtime, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        options = {} if fusions is None else {"fusions": fusions}
        self.attn_boundary, self.ffn_boundary = make_stages(
            (declare_attn(), self.input_layernorm, options),
            (self.ffn_declaration(cfg, layer_id), self.post_attention_layernorm, options),
            previous=self.ffn_declaration(cfg, layer_id - 1) if layer_id != 0 else None,
            terminal=layer_id == cfg.num_hidden_layers - 1,
            runtime=runtime,
            name=f"layer{layer_id}",
        )

    def make_mlp(self, cfg, layer_id: int, runtime: BoundaryRuntime, dtype) -> nn.Module:
        return Qwen3MLP(cfg, runtime, dtype)

    @staticmethod
    def ffn_declaration(cfg, layer_id: int):
        """The FFN declaration of layer ``layer_id`` (also what the next layer names as previous)."""
        return declare_ffn()

    def forward(self, positions, hidden_states, forward_batch):
        hidden_states = self.attn_boundary.prepare(hidden_states, forward_batch)
        if hidden_states.shape[0] != 0:
            hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states = self.attn_boundary.finish(hidden_states, forward_batch)

        hidden_states = self.ffn_boundary.prepare(hidden_states, forward_batch)
        with self.ffn_boundary.exit(forward_batch) as output:
            hidden_states = self.mlp(hidden_states)
        return output.finish(hidden_states)


@register_model
class Qwen3ForCausalLM(CausalLM):
    model_type, config_class = "qwen3", Qwen3Config
    boundary_reduction = "rs+rsv"
    layer_cls = Qwen3DecoderLayer
    check_parallel = staticmethod(check_parallel)

    def stacked_params(self) -> list:
        return [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                ("qkv_proj", "v_proj", "v")]

    def make_kv_cache(self, slots: int, max_len: int) -> KVCache:
        kv_heads = self.model.layers[0].self_attn.qkv_proj.num_kv_heads
        return KVCache(self.stage.layers, slots, max_len, kv_heads,
                       self.config.head_dim, self.dtype, device=self.device)
