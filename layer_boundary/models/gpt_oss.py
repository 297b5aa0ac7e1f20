"""GPT-OSS with layer boundaries: GQA with biases and attention sinks, sliding and full
layers alternating, YaRN rope, and a MoE FFN on every layer.

What transformers' ``modeling_gpt_oss.py`` computes, and where it lives here:

* attention: q/k/v/o with biases (``o_proj``'s added once: on attention-TP rank 0 of the
  partial the boundary sums), a learned logit per head joining each softmax (``sinks``, this
  rank's heads' slice), a window of ``sliding_window`` positions on the ``sliding_attention``
  layers of ``layer_types`` (``cached_attention(window=)`` on a positional cache), the rotary
  frequencies and cos/sin scale of YaRN (``rope.yarn_frequencies``);
* the router: ``linear(x, weight, bias)``, top-k of the logits, softmax over the k chosen;
* the experts (``FusedMoE(bias=True, swiglu_alpha=, swiglu_limit=)``): ``gate_up`` with its
  bias, gate and up interleaved in its columns, ``(clamp(up, -l, l) + 1) * g * sigmoid(a * g)``
  with ``g = clamp(gate, max=l)``, then ``down`` with its bias (added by one rank per expert,
  inside the router weighting); the checkpoint holds each layer's experts fused
  (``experts.gate_up_proj`` [E, hidden, 2 * inter], ``experts.down_proj`` [E, inter, hidden]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import declare_attn, declare_ffn
from ..runtime.args import BoundaryRuntime
from ..runtime.hf_names import NotLinear
from ..runtime.norm import Fp32ScaleRMSNorm
from .config import (BOOL, EXPERTS, FULL, POSITIVE_INT, POSITIVE_NUMBER, SLIDING,
                     SLIDING_FIELDS, CheckpointError, check_divisible,
                     check_heads, layer_windows)
from .layers import DecoderLayer, GqaAttention
from .llama import LlamaForCausalLM
from .llama import read_rope as llama_rope
from .moe import FusedMoE, fused_expert_params
from .registry import dense, register_model
from .rope import YarnRope, inverse_frequencies
from .settings import PER_HEAD, DecoderConfig, setting

ROPE_TYPES = ("yarn", "default")
# transformers' GptOssConfig defaults for what a config.json may leave out
DEFAULT_THETA = 150000.0
DEFAULT_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


def default_layer_types(layers: int) -> list:
    """transformers' default: sliding, full, sliding, ... (even layers slide)."""
    return [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]


def read_yarn(rope: dict, cfg: dict) -> YarnRope:
    """YaRN's parameters from GPT-OSS's rope dict, as transformers reads them."""
    # transformers: a top-level original_max_position_embeddings wins, then the rope
    # dict's, then max_position_embeddings
    original = cfg.get("original_max_position_embeddings") or rope.get(
        "original_max_position_embeddings") or cfg.get("max_position_embeddings", 131072)
    if not POSITIVE_INT.ok(original):
        raise CheckpointError("config.json rope_parameters.original_max_position_embeddings "
                              f"must be {POSITIVE_INT.what}, got {original!r}")
    if "factor" not in rope:
        raise CheckpointError("config.json rope_parameters has no factor (rope_type yarn "
                              "needs it)")
    factor = rope["factor"]
    if factor is None:  # transformers: the ratio of the two context lengths
        factor = cfg.get("max_position_embeddings", 131072) / original
    numbers = {k: rope.get(k) for k in ("beta_fast", "beta_slow", "attention_factor",
                                        "mscale", "mscale_all_dim")}
    for key, value in [("factor", factor), *numbers.items()]:
        if value is not None and not POSITIVE_NUMBER.ok(value):
            raise CheckpointError(f"config.json rope_parameters.{key} must be "
                                  f"{POSITIVE_NUMBER.what}, got {value!r}")
    truncate = rope.get("truncate", True)
    if not BOOL.ok(truncate):
        raise CheckpointError("config.json rope_parameters.truncate must be true or false, "
                              f"got {truncate!r}")
    return YarnRope(float(factor), int(original), float(numbers["beta_fast"] or 32),
                    float(numbers["beta_slow"] or 1), truncate, numbers["attention_factor"],
                    numbers["mscale"], numbers["mscale_all_dim"])


def read_rope(cfg: dict) -> tuple[float, YarnRope | None]:
    """(rope_theta, YaRN's parameters or None for the default rope) of a config.json."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or DEFAULT_YARN
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"config.json rope_type {rope_type!r} is not supported "
                              f"({', '.join(ROPE_TYPES)} only)")
    # Llama's reader checks the theta and partial_rotary_factor (at GPT-OSS's default theta)
    plain = {**rope, "rope_type": "default",
             "rope_theta": rope.get("rope_theta", cfg.get("rope_theta", DEFAULT_THETA))}
    theta, _ = llama_rope(cfg, rope=plain)
    return theta, read_yarn(rope, cfg) if rope_type == "yarn" else None


@dataclass(frozen=True)
class GptOssConfig(DecoderConfig):
    """The dense decoder's sizes (``intermediate_size``: each expert's) with transformers'
    GptOssConfig defaults for what config.json leaves out, the experts, each layer's window,
    the rope (YaRN's, or the default one) and the experts' clamped SwiGLU."""

    num_attention_heads: int = setting(64)
    num_key_value_heads: int = setting(8)
    head_dim: int = setting(64, derive=PER_HEAD)
    num_experts: int = setting(128, names=("num_local_experts", "num_experts"))
    num_experts_per_tok: int = setting(4)
    windows: tuple = ()  # each layer's sliding window (None: full attention)
    rope_theta: float = DEFAULT_THETA
    rope: YarnRope | None = None
    rms_norm_eps: float = setting(1e-5)
    swiglu_alpha: float = setting(1.702, POSITIVE_NUMBER)
    swiglu_limit: float = setting(7.0, POSITIVE_NUMBER)
    attention_bias: bool = setting(True, BOOL)
    tie_word_embeddings: bool = setting(False)
    model_type: str = "gpt_oss"

    checks = {**EXPERTS, **SLIDING_FIELDS, "original_max_position_embeddings": POSITIVE_INT}
    expert_fields, top_k_fields = ("num_local_experts", "num_experts"), ("num_experts_per_tok",)

    @classmethod
    def read(cls, cfg: dict) -> dict:
        """A quantized checkpoint and an activation other than silu refused by name, then the
        declared settings, the rope and each layer's window (128 positions by default)."""
        if cfg.get("quantization_config"):  # the released MXFP4 experts, for one
            raise CheckpointError("config.json quantization_config is not supported "
                                  "(unquantized checkpoints only)")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":  # transformers' experts ignore it; a config naming another is odd
            raise CheckpointError(f"config.json hidden_act {act!r} is not supported (silu "
                                  "only: the experts' clamped SwiGLU)")
        theta, rope = read_rope(cfg)
        values = super().read(cfg)
        window = {"sliding_window": cfg.get("sliding_window", 128)}
        windows = layer_windows({**cfg, **window}, values["num_hidden_layers"],
                                default_layer_types)
        return dict(values, windows=windows, rope_theta=theta, rope=rope)

    def rotary(self) -> tuple[torch.Tensor, float]:
        """The [head_dim / 2] inverse frequencies and the cos/sin scale (YaRN's attention
        factor; 1 for the default rope)."""
        if self.rope is None:
            return inverse_frequencies(self.rope_theta, self.head_dim), 1.0
        return self.rope.frequencies(self.rope_theta, self.head_dim)


def check_parallel(cfg: GptOssConfig, dims) -> None:
    """Heads over attention TP; experts over EP, each expert's intermediate dim over the MoE's
    TP (tp / ep)."""
    check_heads(cfg.num_attention_heads, cfg.num_key_value_heads, dims.attn_tp)
    check_divisible("num_local_experts", cfg.num_experts, "ep", dims.moe_ep)
    check_divisible("intermediate_size", cfg.intermediate_size,
                    "the MoE tensor-parallel size tp/ep", dims.moe_tp)


class GptOssRouter(nn.Module):
    """Top-k of ``linear(x, weight, bias)``, then a softmax over the k chosen logits (in
    their dtype, as transformers)."""

    def __init__(self, cfg: GptOssConfig, dtype):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size,
                                               dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(cfg.num_experts, dtype=dtype),
                                 requires_grad=False)

    def forward(self, x):
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)  # [T, k]
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids


class GptOssMoE(nn.Module):
    """The router, then the experts (a partial over the TP group, a finalize handoff, or the
    dispatched complete output, as the exit and the runtime say)."""

    def __init__(self, cfg: GptOssConfig, runtime: BoundaryRuntime, dtype):
        super().__init__()
        self.router = GptOssRouter(cfg, dtype)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size,
                                runtime.parallel, dtype, swiglu_limit=cfg.swiglu_limit,
                                swiglu_alpha=cfg.swiglu_alpha, bias=True,
                                dispatch=runtime.dispatches_moe)

    def forward(self, x):
        weights, ids = self.router(x)
        return self.experts(x, ids, weights)


class GptOssDecoderLayer(DecoderLayer):
    """GQA with biases and sinks (sliding or full, PARTIAL), then the MoE; the norms scale in
    fp32 and round once (transformers keeps GPT-OSS's norms in fp32)."""

    def __init__(self, cfg: GptOssConfig, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, dtype, input_norms=False)
        self.input_layernorm = Fp32ScaleRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = Fp32ScaleRMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                         dtype=dtype)
        inv_freq, scale = cfg.rotary()
        self.self_attn = GqaAttention.of(
            cfg, layer_id, runtime, dtype, bias=cfg.attention_bias, inv_freq=inv_freq,
            rope_scale=scale, window=cfg.windows[layer_id], sinks=True)
        self.mlp = GptOssMoE(cfg, runtime, dtype)
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        # the attention's linears move the rows of a sequence-parallel batch; the experts do
        # not (the boundary gathers their input and reduce-scatters the sum)
        return (declare_attn(sequence_parallel=True),
                declare_ffn(sparse=True, next_sparse=index + 1 < cfg.num_hidden_layers,
                            dispatches=runtime.dispatches_moe))


@register_model("gpt_oss", GptOssConfig, architectures=("GptOssForCausalLM",),
                **dense(check_parallel=check_parallel, moe_a2a=True))
class GptOssForCausalLM(LlamaForCausalLM):
    """Llama's model (q/k/v stacked, a positional cache: the sliding layers mask their own
    window) with GPT-OSS's layers and final norm; the experts load from the fused per-layer
    tensors."""

    layer_cls = GptOssDecoderLayer
    transformers_names = (NotLinear(r".*\.mlp\.router"),)  # its router is no nn.Linear


    @staticmethod
    def final_norm(cfg, dtype) -> torch.nn.Module:
        return Fp32ScaleRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)  # the layers'

    def stacked_params(self) -> list:
        return super().stacked_params() + fused_expert_params()
