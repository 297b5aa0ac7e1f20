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
from ..runtime.embedding import ParallelLMHead
from ..runtime.norm import LayerNorm
from .base import CausalLM, vocab_embedding
from .config import (BOOL, POSITIVE_NUMBER, CheckpointError, check_unquantized_silu,
                     default_rope, theta_of)
from .head import ScaledLMHead
from .layers import QKV_PARAMS, DecoderLayer, GatedMLP, GqaAttention
from .registry import PARALLEL_BLOCK_DP, dense, register_model
from .rope import inverse_frequencies
from .settings import PER_HEAD, DecoderConfig, Null, setting

# a parallel block's attention completes on scattered rows in a sequence-parallel batch,
# which its MLP's partial does not hold
NO_SP = "its parallel blocks join the attention's partial to the MLP's sum on unscattered rows"


@dataclass(frozen=True)
class CohereConfig(DecoderConfig):
    # transformers keeps a null head_dim as None (and fails on it)
    head_dim: int = setting(derive=PER_HEAD, null=Null.REFUSE)
    layer_norm_eps: float = setting(1e-5)
    rope_theta: float = 500000.0  # the default rope's (``default_rope``): transformers' Cohere
    logit_scale: float = setting(0.0625, POSITIVE_NUMBER)
    tie_word_embeddings: bool = setting(True)
    attention_bias: bool = setting(False, BOOL)
    model_type: str = "cohere"

    checks = {"use_qk_norm": BOOL}

    @classmethod
    def read(cls, cfg: dict) -> dict:
        """The declared settings and the default rope's theta; Command-R+'s q/k norm, a
        quantized checkpoint and an activation other than silu refused by name."""
        check_unquantized_silu(cfg)
        if cfg.get("use_qk_norm"):
            raise CheckpointError("config.json use_qk_norm=true is not supported (Command-R+'s "
                                  "per-head q/k LayerNorm)")
        theta = theta_of(default_rope(cfg), cfg, cls.default_of("rope_theta"))
        return dict(super().read(cfg), rope_theta=theta)

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
        self.self_attn = GqaAttention.of(
            cfg, layer_id, runtime, dtype, bias=cfg.attention_bias, inv_freq=inv_freq,
            interleaved=True, window=cfg.layer_window(layer_id))
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, runtime, dtype)
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")

    def read_norms(self) -> tuple:
        return self.input_layernorm, self.input_layernorm  # one norm feeds both

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        return declare_attn(), declare_ffn(parallel=True)


@register_model("cohere", CohereConfig, architectures=("CohereForCausalLM",),
                **dense(sequence_parallel=NO_SP))
class CohereForCausalLM(CausalLM):
    """Command-R: parallel blocks, LayerNorms without bias, interleaved rotary, a scaled and
    (by default) tied head; q/k/v load stacked."""

    layer_cls = CohereDecoderLayer
    batch_invariant_dp = PARALLEL_BLOCK_DP  # (a tp 2 dp 2 request: 6e-7 apart on DP rank 1)

    @staticmethod
    def final_norm(cfg, dtype) -> torch.nn.Module:
        return LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, bias=False, dtype=dtype)

    def make_head(self, cfg, runtime, dtype) -> ParallelLMHead:
        return vocab_embedding(cfg, runtime, dtype, ScaledLMHead, scale=cfg.logit_scale)

    def stacked_params(self) -> list:
        return list(QKV_PARAMS)
