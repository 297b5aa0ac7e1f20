"""Cohere (Command-R) with layer boundaries: a parallel block, ``x + attn(ln(x)) + mlp(ln(x))``.

Facts from transformers' ``modeling_cohere``: one ``input_layernorm`` per layer (a LayerNorm
without bias, computed in fp32: ``CohereLayerNorm``) feeds both the attention and the gated
MLP, and the layer returns ``residual + attn + mlp``; the rotary embedding rotates interleaved
pairs (``repeat_interleave`` of the frequencies, ``rotate_half`` over even/odd dims); the final
norm is the same LayerNorm; the logits are multiplied by ``logit_scale``; the head is tied by
default. ``use_qk_norm`` (Command-R+'s per-head LayerNorm of q and k) is refused by name.

The layer is two stages: a PARTIAL attention and an FFN declared ``parallel=True``, both read
through the one norm, so the attention's partial joins the MLP's sum and one collective a
layer completes both (``parallel_block.py``). Parameter names follow the checkpoint (q/k/v
and gate/up stacked at load time, as Llama's are).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import declare_attn, declare_ffn
from ..runtime.args import BoundaryRuntime
from ..runtime.norm import LayerNorm
from .config import (BOOL, DECODER, POSITIVE_NUMBER, CheckedConfig, CheckpointError,
                     check_unquantized_silu, default_rope, number, require, required, theta_of)
from .head import ScaledLMHead, rebuilt_as
from .layers import DecoderLayer, GatedMLP, GqaAttention
from .llama import LlamaForCausalLM, check_parallel
from .registry import NO_MOE_LAYERS, NO_QKV_LATENT, PARALLEL_BLOCK_DP, register_model
from .rope import inverse_frequencies

# a parallel block's attention completes on scattered rows in a sequence-parallel batch,
# which its MLP's partial does not hold
NO_SP = "its parallel blocks join the attention's partial to the MLP's sum on unscattered rows"


def _head_dim(cfg: dict, heads: int) -> int:
    """config.json's head_dim, else hidden_size / num_attention_heads as transformers derives
    it where the field is absent; a null one transformers keeps as None (and fails on)."""
    if "head_dim" not in cfg:
        return require(cfg, "hidden_size") // heads
    if cfg["head_dim"] is None:
        raise CheckpointError("config.json field head_dim is null: give a number, or leave it "
                              "out for hidden_size / num_attention_heads")
    return cfg["head_dim"]


@dataclass(frozen=True)
class CohereConfig(CheckedConfig):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    logit_scale: float = 0.0625
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    model_type: str = "cohere"

    fields = {**DECODER, "logit_scale": POSITIVE_NUMBER, "use_qk_norm": BOOL}

    @classmethod
    def from_dict(cls, cfg: dict) -> CohereConfig:
        return cls(**cls.read(cfg))

    @classmethod
    def read(cls, cfg: dict) -> dict:
        """The dataclass fields of a config.json (what Cohere2's reader extends)."""
        check_unquantized_silu(cfg)
        if cfg.get("use_qk_norm"):
            raise CheckpointError("config.json use_qk_norm=true is not supported (Command-R+'s "
                                  "per-head q/k LayerNorm)")
        rope = default_rope(cfg)
        heads = require(cfg, "num_attention_heads")
        return dict(
            **required(cfg, "vocab_size", "hidden_size", "intermediate_size",
                       "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=_head_dim(cfg, heads),
            layer_norm_eps=number(cfg, "layer_norm_eps", 1e-5),
            rope_theta=theta_of(rope, cfg, 10000.0),
            logit_scale=number(cfg, "logit_scale", 0.0625),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            attention_bias=bool(cfg.get("attention_bias", False)))

    def layer_window(self, index: int) -> int | None:
        """Layer ``index``'s sliding window (Command-R has none)."""
        return None

    def layer_rope(self, index: int) -> bool:
        """Whether layer ``index`` rotates q and k (every Command-R layer does)."""
        return True


class CohereDecoderLayer(DecoderLayer):
    """A parallel block: the attention (interleaved rotary, PARTIAL) and the gated MLP both
    read ``input_layernorm(x)``; the MLP's stage is declared ``parallel=True``."""

    def __init__(self, cfg: CohereConfig, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__(cfg.hidden_size, cfg.layer_norm_eps, dtype, input_norms=False)
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, bias=False,
                                         dtype=dtype)
        inv_freq = (inverse_frequencies(cfg.rope_theta, cfg.head_dim)
                    if cfg.layer_rope(layer_id) else None)
        self.self_attn = GqaAttention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            layer_id, runtime, dtype, bias=cfg.attention_bias, inv_freq=inv_freq,
            interleaved=True, window=cfg.layer_window(layer_id))
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, runtime, dtype)
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")

    def read_norms(self) -> tuple:
        return self.input_layernorm, self.input_layernorm  # one norm feeds both

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        return declare_attn(), declare_ffn(parallel=True)


@register_model("cohere", CohereConfig, architectures=("CohereForCausalLM",),
                boundary_reduction="rs+rsv", positional_cache=True,
                check_parallel=check_parallel, context_parallel=True, sequence_parallel=NO_SP,
                attn_input_scattered=NO_QKV_LATENT, moe_a2a=NO_MOE_LAYERS,
                batch_invariant=True)
class CohereForCausalLM(LlamaForCausalLM):
    """Command-R: parallel blocks, LayerNorms without bias, interleaved rotary, a scaled and
    (by default) tied head."""

    layer_cls = CohereDecoderLayer
    batch_invariant_dp = PARALLEL_BLOCK_DP  # (a tp 2 dp 2 request: 6e-7 apart on DP rank 1)

    @staticmethod
    def final_norm(cfg, dtype) -> torch.nn.Module:
        return LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, bias=False, dtype=dtype)

    def __init__(self, cfg: CohereConfig, runtime, dtype=torch.float32, fusions=None):
        super().__init__(cfg, runtime, dtype, fusions)
        if self.stage.last:
            self.lm_head = rebuilt_as(self.lm_head, ScaledLMHead, scale=cfg.logit_scale)
