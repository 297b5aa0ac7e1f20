"""OLMo-2 with layer boundaries: a post-norm decoder.

Each layer reads the residual as it is (no input norms) and normalises each stage's complete
output with that stage's own norm before the add (the post-norm residual kind,
``residual.post_norm.PostNormAdd``)::

    h = x + post_attention_layernorm(attn(x));  out = h + post_feedforward_layernorm(mlp(h))

The q/k norms span every head (``q_norm`` over ``heads * head_dim``): under attention TP
each rank holds its heads' slice of their weights and sums its squares with the other ranks'
(``GqaAttention(qk_norm_width=...)``). Its norms scale in fp32 and round once
(``Fp32ScaleRMSNorm``). OLMo-3 (``olmo3.py``) is this model with sliding-window layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.args import BoundaryRuntime
from ..runtime.norm import Fp32ScaleRMSNorm
from .base import CausalLM
from .layers import QKV_PARAMS, GatedMLP, GqaAttention, PostNormDecoderLayer
from .llama import LlamaConfig, read_rope
from .registry import dense, register_model


@dataclass(frozen=True)
class Olmo2Config(LlamaConfig):
    # transformers' OLMo-2 has no MLP bias (attention_bias covers q/k/v/o)
    mlp_bias: bool = False
    model_type: str = "olmo2"

    @classmethod
    def read_rope_fields(cls, cfg: dict, values: dict) -> dict:
        # transformers' reading (``convert_rope_params_to_dict``): a legacy rope_scaling, where
        # given, replaces rope_parameters whole, so its type wins and its theta comes from it
        # or the top-level rope_theta, never from rope_parameters
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        theta, scaling = read_rope(cfg, cls.rope_types, cls.default_of("rope_theta"), rope)
        return {"rope_theta": theta, "rope": scaling}

    def window(self, index: int) -> int | None:
        """Layer ``index``'s sliding window (None: every position)."""
        return None

    def layer_rotary(self, index: int) -> tuple[torch.Tensor, float]:
        """Layer ``index``'s rotary inverse frequencies and cos/sin scale (YaRN's attention
        factor, OLMo-3's; one rope for every layer here)."""
        return self.inverse_frequencies(), 1.0


class Olmo2DecoderLayer(PostNormDecoderLayer):
    """Attention (q/k norms over every head, PARTIAL) then the gated MLP, each read as the
    residual is and each output through the stage's own post norm before the add."""

    def __init__(self, cfg: Olmo2Config, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        inv_freq, rope_scale = cfg.layer_rotary(layer_id)
        self.self_attn = GqaAttention.of(
            cfg, layer_id, runtime, dtype, bias=cfg.attention_bias, qk_norm_eps=eps,
            qk_norm_width="fp32", inv_freq=inv_freq, rope_scale=rope_scale,
            window=cfg.window(layer_id))
        self.mlp = GatedMLP(h, cfg.intermediate_size, runtime, dtype)
        self.post_attention_layernorm = Fp32ScaleRMSNorm(h, eps, dtype=dtype)
        self.post_feedforward_layernorm = Fp32ScaleRMSNorm(h, eps, dtype=dtype)
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")


# What ``auto`` resolves to for OLMo-2 and OLMo-3 (the same layers), chosen by measurement:
# ``rs+rsv``, chosen per batch. The post norm never moves before a sum, so the add-before-sum
# shortcut that favours ``ar`` is gone: on OLMo-3's tiny checkpoint at tp 4 dp 2 (DP ranks
# holding 31 and 2 prompt tokens; ``bench.path_bytes``) its choice moved the fewest ledger
# bytes of ar, rs and rsv in the prefill (rsv: 46.4 kB, against 54.9 kB for ar and 70.8 kB for
# rs) and in the decode step (rsv: 4.7 kB against 5.7 kB for ar).
AUTO = "rs+rsv"


@register_model("olmo2", Olmo2Config, architectures=("Olmo2ForCausalLM",),
                **dense(boundary_reduction=AUTO))
class Olmo2ForCausalLM(CausalLM):
    """OLMo-2: post norms as residual updates, q/k norms over every head, the final norm
    as the post norms compute (fp32 scale), a positional cache (OLMo-3's sliding layers
    mask their own window); q/k/v load stacked."""

    layer_cls = Olmo2DecoderLayer

    @staticmethod
    def final_norm(cfg, dtype) -> torch.nn.Module:
        return Fp32ScaleRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def stacked_params(self) -> list:
        return list(QKV_PARAMS)
