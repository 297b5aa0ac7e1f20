"""Llama with layer boundaries: Qwen3's dense decoder without the per-head q/k norm, with
Llama's rotary variants (``default`` and Llama 3's ``llama3`` frequency scaling) and optional
attention and MLP biases. Parameter names follow the Hugging Face checkpoint (q/k/v are
stacked into ``qkv_proj`` at load time, as Qwen3's are).

Mistral (``mistral.py``) is this model with a sliding attention window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import declare_attn, declare_ffn
from ..runtime.args import BoundaryRuntime
from .config import (BOOL, DECODER, POSITIVE_INT, POSITIVE_NUMBER, CheckpointError,
                     check_unquantized_silu)
from .kv_cache import KVCache
from .layers import DecoderLayer, GatedMLP, GqaAttention
from .qwen3 import Qwen3Config, Qwen3ForCausalLM, check_tp
from .registry import NO_MOE_LAYERS, NO_QKV_LATENT, register_model
from .rope import inverse_frequencies

ROPE_TYPES = ("default", "llama3")


def _rope_number(rope: dict, key: str, check=POSITIVE_NUMBER):
    """A number of the rope dict (``rope_parameters`` / ``rope_scaling``), checked."""
    value = rope.get(key)
    if value is None:
        raise CheckpointError(f"config.json rope_parameters has no {key} (rope_type llama3 "
                              "needs it)")
    if not check.ok(value):
        raise CheckpointError(f"config.json rope_parameters.{key} must be {check.what}, got "
                              f"{value!r}")
    return value


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3's rotary frequency scaling (``rope_type`` llama3): wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``, those
    shorter than ``original_max_position_embeddings / high_freq_factor`` kept, the band between
    interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @classmethod
    def read(cls, rope: dict, cfg: dict) -> Llama3Rope:
        low = _rope_number(rope, "low_freq_factor")
        high = _rope_number(rope, "high_freq_factor")
        if high <= low:
            raise CheckpointError(f"config.json rope_parameters.high_freq_factor={high} must "
                                  f"exceed low_freq_factor={low}")
        # transformers: a top-level original_max_position_embeddings wins, then the rope
        # dict's, then max_position_embeddings
        context = {**rope, **{k: cfg[k] for k in ("original_max_position_embeddings",)
                              if cfg.get(k) is not None}}
        if context.get("original_max_position_embeddings") is None:
            context["original_max_position_embeddings"] = cfg.get("max_position_embeddings")
        return cls(float(_rope_number(rope, "factor")), float(low), float(high),
                   _rope_number(context, "original_max_position_embeddings", POSITIVE_INT))

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled [D/2] inverse frequencies (the arithmetic of transformers' llama3 rope
        in the same order, so the fp32 values agree exactly)."""
        context = self.original_max_position_embeddings
        low_wavelen = context / self.low_freq_factor  # longer than this: divided by factor
        high_wavelen = context / self.high_freq_factor  # shorter than this: kept
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = ((context / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(between, smoothed, scaled)


def read_rope(cfg: dict) -> tuple[float, Llama3Rope | None]:
    """(rope_theta, the llama3 scaling or None) of a config.json; other rope types refused
    by name."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"config.json rope_type {rope_type!r} is not supported "
                              f"({', '.join(ROPE_TYPES)} only)")
    for where in (cfg, rope):
        partial = where.get("partial_rotary_factor")
        if partial is not None and partial != 1:
            raise CheckpointError(f"config.json partial_rotary_factor={partial!r} is not "
                                  "supported (the whole head rotates)")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if not POSITIVE_NUMBER.ok(theta):
        raise CheckpointError(f"config.json rope_theta must be {POSITIVE_NUMBER.what}, got "
                              f"{theta!r}")
    return float(theta), Llama3Rope.read(rope, cfg) if rope_type == "llama3" else None


@dataclass(frozen=True)
class LlamaConfig(Qwen3Config):
    """The dense decoder fields Qwen3 reads (Qwen3's reader reads them here too), and Llama's
    own: ``mlp_bias`` and the llama3 rope scaling (``rope``)."""

    mlp_bias: bool = False
    rope: Llama3Rope | None = None
    model_type: str = "llama"

    fields = {**DECODER, "mlp_bias": BOOL, "original_max_position_embeddings": POSITIVE_INT}

    @classmethod
    def from_dict(cls, cfg: dict) -> LlamaConfig:
        return cls(**cls.read(cfg))

    @classmethod
    def read(cls, cfg: dict) -> dict:
        """The dataclass fields of a config.json (what a subclass extends)."""
        check_unquantized_silu(cfg)
        theta, rope = read_rope(cfg)
        # the rope is read above; Qwen3's reader sees its plain form
        dense = Qwen3Config.from_dict({**cfg, "rope_parameters": {"rope_theta": theta},
                                       "rope_scaling": None}).__dict__
        dense.pop("model_type")
        return dict(dense, mlp_bias=bool(cfg.get("mlp_bias", False)), rope=rope)

    def inverse_frequencies(self) -> torch.Tensor:
        """The [head_dim / 2] rotary inverse frequencies, scaled for llama3."""
        inv_freq = inverse_frequencies(self.rope_theta, self.head_dim)
        return inv_freq if self.rope is None else self.rope.scale(inv_freq)


def check_parallel(cfg: LlamaConfig, dims) -> None:
    """Query and kv heads over attention TP, ``intermediate_size`` over TP."""
    check_tp(cfg, dims.attn_tp, dims.tp)


class LlamaDecoderLayer(DecoderLayer):
    """GQA with rotary embedding and no q/k norm (PARTIAL: ``o_proj`` never reduces, the
    boundary owns the attention-TP sum), then the gated MLP over TP."""

    def __init__(self, cfg: LlamaConfig, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = GqaAttention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            layer_id, runtime, dtype, bias=cfg.attention_bias,
            inv_freq=cfg.inverse_frequencies())
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, runtime, dtype,
                            bias=cfg.mlp_bias)
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        # the attention's and the gated MLP's linears move the rows in a sequence-parallel batch
        return declare_attn(sequence_parallel=True), declare_ffn(sequence_parallel=True)


@register_model("llama", LlamaConfig, architectures=("LlamaForCausalLM",),
                boundary_reduction="rs+rsv", positional_cache=True,
                check_parallel=check_parallel, context_parallel=True, sequence_parallel=True,
                attn_input_scattered=NO_QKV_LATENT, moe_a2a=NO_MOE_LAYERS,
                batch_invariant=True)
class LlamaForCausalLM(Qwen3ForCausalLM):
    """Qwen3's skeleton (stacked q/k/v) with Llama's layers; ``kv_window`` is the attention
    window the cache keeps (None: every position)."""

    layer_cls = LlamaDecoderLayer

    def kv_window(self) -> int | None:
        return None

    def make_kv_cache(self, slots: int, max_len: int) -> KVCache:
        attn = self.model.layers[0].self_attn
        return KVCache(self.stage.layers, slots, max_len, attn.qkv_proj.num_kv_heads,
                       attn.head_dim, self.dtype, device=self.device, window=self.kv_window())
