"""Llama with layer boundaries: the dense decoder the other dense models build on. GQA with
rotary embedding (``default``, or Llama 3's ``llama3`` frequency scaling), a gated MLP,
pre-norm RMSNorms, optional attention and MLP biases. Parameter names follow the Hugging
Face checkpoint (q/k/v are stacked into ``qkv_proj`` at load time).

Qwen3 (``qwen3.py``) is this model with a per-head q/k norm; Mistral (``mistral.py``) with a
sliding attention window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .. import declare_attn, declare_ffn
from ..runtime.args import BoundaryRuntime
from .base import CausalLM
from .config import BOOL, POSITIVE_INT, POSITIVE_NUMBER, CheckpointError, check_unquantized_silu
from .layers import QKV_PARAMS, DecoderLayer, GatedMLP, GqaAttention
from .registry import dense, register_model
from .rope import inverse_frequencies
from .settings import DecoderConfig, setting

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


def read_rope(cfg: dict, types: tuple = ROPE_TYPES, default: float = 10000.0,
              rope: dict | None = None) -> tuple[float, Llama3Rope | None]:
    """(rope_theta, the llama3 scaling or None) of a config.json: of ``rope`` (None: its
    ``rope_parameters``, else its legacy ``rope_scaling``), its theta else the top-level one
    else ``default``; a rope type outside ``types`` and a partial rotary refused by name."""
    if rope is None:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in types:
        raise CheckpointError(f"config.json rope_type {rope_type!r} is not supported "
                              f"({', '.join(types)} only)")
    for where in (cfg, rope):
        partial = where.get("partial_rotary_factor")
        if partial is not None and partial != 1:
            raise CheckpointError(f"config.json partial_rotary_factor={partial!r} is not "
                                  "supported (the whole head rotates)")
    theta = rope.get("rope_theta", cfg.get("rope_theta", default))
    if not POSITIVE_NUMBER.ok(theta):
        raise CheckpointError(f"config.json rope_theta must be {POSITIVE_NUMBER.what}, got "
                              f"{theta!r}")
    return float(theta), Llama3Rope.read(rope, cfg) if rope_type == "llama3" else None


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """The dense decoder's sizes (``DecoderConfig``) and Llama's fields: the norms' epsilon,
    a tied head, biases on the attention and the MLP, the rope (its theta and Llama 3's
    scaling, ``rope``: ``read_rope``)."""

    rms_norm_eps: float = setting(1e-6)
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = setting(False)
    attention_bias: bool = setting(False, BOOL)
    mlp_bias: bool = setting(False, BOOL)
    rope: Llama3Rope | None = None
    model_type: str = "llama"

    checks = {"original_max_position_embeddings": POSITIVE_INT}  # llama3's, read by its rope
    rope_types: ClassVar[tuple] = ROPE_TYPES  # the rope types it computes

    @classmethod
    def read(cls, cfg: dict) -> dict:
        """What the model does not compute refused (``refuse``), then the declared settings
        and the rope (``read_rope_fields``)."""
        cls.refuse(cfg)
        values = super().read(cfg)
        return dict(values, **cls.read_rope_fields(cfg, values))

    @classmethod
    def refuse(cls, cfg: dict) -> None:
        """Refuse by name what the model does not compute, before anything is read: a
        quantized checkpoint, an activation other than silu."""
        check_unquantized_silu(cfg)

    @classmethod
    def read_rope_fields(cls, cfg: dict, values: dict) -> dict:
        """The rope's fields of a config.json (``values``: the settings read), as a model
        whose rope reads otherwise (per layer type, a partial rotary) replaces them."""
        theta, rope = read_rope(cfg, cls.rope_types, cls.default_of("rope_theta"))
        return {"rope_theta": theta, "rope": rope}

    def inverse_frequencies(self) -> torch.Tensor:
        """The [head_dim / 2] rotary inverse frequencies, scaled for llama3."""
        inv_freq = inverse_frequencies(self.rope_theta, self.head_dim)
        return inv_freq if self.rope is None else self.rope.scale(inv_freq)


class LlamaDecoderLayer(DecoderLayer):
    """GQA with rotary embedding (``make_attention``; PARTIAL: ``o_proj`` never reduces, the
    boundary owns the attention-TP sum; a per-head RMSNorm on q and k where ``qk_norm``:
    Qwen3's), then the FFN (``make_mlp``: the gated MLP over TP)."""

    qk_norm = False

    def __init__(self, cfg: LlamaConfig, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = self.make_attention(cfg, layer_id, runtime, dtype)
        self.mlp = self.make_mlp(cfg, layer_id, runtime, dtype)
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")

    def make_attention(self, cfg, layer_id: int, runtime: BoundaryRuntime, dtype) -> nn.Module:
        """Layer ``layer_id``'s attention: GQA with the config's rotary embedding."""
        return GqaAttention.of(cfg, layer_id, runtime, dtype, bias=cfg.attention_bias,
                               qk_norm_eps=cfg.rms_norm_eps if self.qk_norm else None,
                               inv_freq=cfg.inverse_frequencies())

    def make_mlp(self, cfg, layer_id: int, runtime: BoundaryRuntime, dtype) -> nn.Module:
        """Layer ``layer_id``'s FFN: the gated MLP (Qwen3-MoE's experts where it is sparse)."""
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, runtime, dtype,
                        bias=cfg.mlp_bias)

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        # the attention's and the gated MLP's linears move the rows in a sequence-parallel batch
        return declare_attn(sequence_parallel=True), declare_ffn(sequence_parallel=True)


@register_model("llama", LlamaConfig, architectures=("LlamaForCausalLM",), **dense())
class LlamaForCausalLM(CausalLM):
    """Llama: ``CausalLM``'s skeleton with Llama's layers; q/k/v load stacked."""

    layer_cls = LlamaDecoderLayer

    def stacked_params(self) -> list:
        return list(QKV_PARAMS)
