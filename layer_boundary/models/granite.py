"""IBM Granite (3.x dense) with layer boundaries: Llama with four constants of the config.

What transformers' ``modeling_granite.py`` adds to Llama, and where it lives here:

* ``embedding_multiplier``: the embedding's output times it (``inputs_embeds *
  embedding_multiplier``, a Python float on the model-dtype rows: ``head.ScaledEmbedding``);
* ``attention_multiplier``: the softmax scale itself, in place of ``head_dim ** -0.5``
  (``GqaAttention(scaling=)``);
* ``residual_multiplier``: each stage's output scaled before it joins the residual,
  ``residual + out * residual_multiplier`` (the scaled residual update,
  ``residual.scaled.ScaledAdd``, declared on both producers of every layer; the plain add
  where it is 1);
* ``logits_scaling``: the logits divided by it (``head.ScaledLMHead.divisor``).

Every multiplier defaults to 1, as transformers' ``GraniteConfig`` does. The rest is Llama's:
GQA with optional biases, the default or llama3 rope, a SwiGLU MLP with an optional bias,
RMSNorms that round then scale, a head tied or not. GraniteMoE (``granitemoe.py``) is this
model with its MoE FFN.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import declare_attn, declare_ffn
from ..residual.scaled import scaled_update
from ..runtime.args import BoundaryRuntime
from ..runtime.embedding import ParallelLMHead, VocabParallelEmbedding
from .base import CausalLM, vocab_embedding
from .config import POSITIVE_NUMBER
from .head import ScaledEmbedding, ScaledLMHead
from .layers import QKV_PARAMS, DecoderLayer, GatedMLP, GqaAttention
from .llama import LlamaConfig
from .registry import dense, register_model
from .settings import setting



@dataclass(frozen=True)
class GraniteConfig(LlamaConfig):
    """Llama's fields (``mlp_bias``, the llama3 rope) and Granite's four multipliers (each
    defaulting to 1, as transformers' ``GraniteConfig``)."""

    embedding_multiplier: float = setting(1.0, POSITIVE_NUMBER)
    attention_multiplier: float = setting(1.0, POSITIVE_NUMBER)
    residual_multiplier: float = setting(1.0, POSITIVE_NUMBER)
    logits_scaling: float = setting(1.0, POSITIVE_NUMBER)
    model_type: str = "granite"


def granite_attention(cfg: GraniteConfig, layer_id: int, runtime: BoundaryRuntime, dtype):
    """GQA whose softmax scale is ``attention_multiplier`` (PARTIAL: ``o_proj`` never
    reduces, the boundary owns the attention-TP sum)."""
    return GqaAttention.of(cfg, layer_id, runtime, dtype, bias=cfg.attention_bias,
                           inv_freq=cfg.inverse_frequencies(), scaling=cfg.attention_multiplier)


class GraniteDecoderLayer(DecoderLayer):
    """Llama's layer (GQA, then the gated MLP over TP) whose two outputs join the residual
    scaled by ``residual_multiplier``."""

    def __init__(self, cfg: GraniteConfig, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = granite_attention(cfg, layer_id, runtime, dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, runtime, dtype,
                            bias=cfg.mlp_bias)
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        # the update is a constant of the config: a neighbour's declaration is the same one
        update = scaled_update(cfg.residual_multiplier)
        return (declare_attn(sequence_parallel=True, update=update),
                declare_ffn(sequence_parallel=True, update=update))


@register_model("granite", GraniteConfig, architectures=("GraniteForCausalLM",), **dense())
class GraniteForCausalLM(CausalLM):
    """Granite's layers on a positional cache, its embedding scaled by
    ``embedding_multiplier`` and its logits divided by ``logits_scaling``; q/k/v load
    stacked."""

    layer_cls = GraniteDecoderLayer

    def make_embedding(self, cfg, runtime, dtype) -> VocabParallelEmbedding:
        return vocab_embedding(cfg, runtime, dtype, ScaledEmbedding,
                               scale=cfg.embedding_multiplier)

    def make_head(self, cfg, runtime, dtype) -> ParallelLMHead:
        return vocab_embedding(cfg, runtime, dtype, ScaledLMHead, divisor=cfg.logits_scaling)

    def stacked_params(self) -> list:
        return list(QKV_PARAMS)
