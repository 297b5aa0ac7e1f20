"""Qwen3 (dense) with layer boundaries. Compute is plain PyTorch; parameter names follow the
Hugging Face checkpoint (q/k/v are stacked into ``qkv_proj`` at load time)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .. import declare_attn, declare_ffn
from ..runtime.args import BoundaryRuntime
from .base import CausalLM
from .kv_cache import KVCache
from .layers import DecoderLayer, GatedMLP, GqaAttention
from .rope import inverse_frequencies
from .config import (DECODER, CheckedConfig, CheckpointError, default_rope, fp8_quantization,
                     number, quantized_read, require, required, theta_of)
from .registry import NO_MOE_LAYERS, NO_QKV_LATENT, register_model


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
    # quantization_config (config.fp8_quantization): the FP8 weights' [out, in] block and the
    # modules left unquantized; None: an unquantized checkpoint
    fp8_block: tuple | None = None
    fp8_skip: tuple = ()
    model_type: str = "qwen3"

    fields = DECODER

    @classmethod
    def from_dict(cls, cfg: dict) -> Qwen3Config:
        rope = default_rope(cfg)
        if cfg.get("use_sliding_window"):
            raise CheckpointError("config.json use_sliding_window=true is not supported")
        heads = require(cfg, "num_attention_heads")
        block, skip = fp8_quantization(cfg)
        return cls(
            fp8_block=block, fp8_skip=skip,
            **required(cfg, "vocab_size", "hidden_size", "intermediate_size",
                       "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or require(cfg, "hidden_size") // heads,
            rms_norm_eps=number(cfg, "rms_norm_eps", 1e-6),
            rope_theta=theta_of(rope, cfg, 10000.0),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )


def check_parallel(cfg: Qwen3Config, dims) -> None:
    check_tp(cfg, dims.attn_tp, dims.tp)


def check_heads(heads: int, kv_heads: int, attn_tp: int,
                names: tuple = ("num_attention_heads", "num_key_value_heads")) -> None:
    """Query heads split over attention TP; kv heads split, or replicated over whole ranks
    (``names``: the config fields that count them)."""
    if heads % attn_tp:
        raise ValueError(f"{names[0]}={heads} is not divisible by attention tp={attn_tp}")
    if (kv_heads % attn_tp) if kv_heads >= attn_tp else (attn_tp % kv_heads):
        raise ValueError(f"{names[1]}={kv_heads} and attention tp={attn_tp}: one must divide "
                         "the other")


def check_tp(cfg: Qwen3Config, attn_tp: int, tp: int) -> None:
    """Reject a topology this config cannot be sharded over, naming the config field."""
    check_heads(cfg.num_attention_heads, cfg.num_key_value_heads, attn_tp)
    if cfg.intermediate_size % tp:
        raise ValueError(f"intermediate_size={cfg.intermediate_size} is not divisible by tp={tp}")


def Qwen3Attention(cfg: Qwen3Config, layer_id: int, runtime: BoundaryRuntime, dtype):
    """GQA with a per-head q/k RMSNorm and rotary embedding; PARTIAL: ``o_proj`` never
    reduces, the boundary owns the attention-TP sum."""
    return GqaAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                        cfg.head_dim, layer_id, runtime, dtype, bias=cfg.attention_bias,
                        qk_norm_eps=cfg.rms_norm_eps,
                        inv_freq=inverse_frequencies(cfg.rope_theta, cfg.head_dim))


def Qwen3MLP(cfg: Qwen3Config, runtime: BoundaryRuntime, dtype):
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, runtime, dtype)


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, cfg: Qwen3Config, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Qwen3Attention(cfg, layer_id, runtime, dtype)
        self.mlp = self.make_mlp(cfg, layer_id, runtime, dtype)
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")

    def make_mlp(self, cfg, layer_id: int, runtime: BoundaryRuntime, dtype) -> nn.Module:
        return Qwen3MLP(cfg, runtime, dtype)

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        """GQA (PARTIAL), then the FFN; both sequence-parallel (their linears move the rows);
        an FP8 checkpoint's q/k/v read quantized inputs."""
        attn = declare_attn(sequence_parallel=True, read=quantized_read(
            cfg, index, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")))
        return attn, cls.ffn_declaration(cfg, index, runtime)

    @staticmethod
    def ffn_declaration(cfg, layer_id: int, runtime: BoundaryRuntime):
        """The FFN declaration of layer ``layer_id``: a gated MLP of column- and row-parallel
        linears, sequence-parallel."""
        return declare_ffn(sequence_parallel=True,
                           read=quantized_read(cfg, layer_id, ("mlp.gate_proj", "mlp.up_proj")))


@register_model("qwen3", Qwen3Config, architectures=("Qwen3ForCausalLM",),
                check_parallel=check_parallel, boundary_reduction="rs+rsv",
                positional_cache=True, context_parallel=True, sequence_parallel=True,
                attn_input_scattered=NO_QKV_LATENT, moe_a2a=NO_MOE_LAYERS,
                batch_invariant=True)
class Qwen3ForCausalLM(CausalLM):
    """Qwen3 (dense): GQA with per-head q/k norms and a gated MLP; q/k/v load stacked."""

    layer_cls = Qwen3DecoderLayer

    def stacked_params(self) -> list:
        return [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                ("qkv_proj", "v_proj", "v")]

    def make_kv_cache(self, slots: int, max_len: int) -> KVCache:
        kv_heads = self.model.layers[0].self_attn.qkv_proj.num_kv_heads
        return KVCache(self.stage.layers, slots, max_len, kv_heads,
                       self.config.head_dim, self.dtype, device=self.device)
