"""Gemma-3 (text) with layer boundaries: sandwich norms around both stages.

Each stage reads the residual through its input norm and normalises its complete output with
its own post norm before the add (``residual.post_norm.PostNormAdd`` on the producer, the
ordinary add+norm read on the consumer)::

    h = x + post_attention_layernorm(attn(input_layernorm(x)))
    out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

Every norm is the zero-centered one (``GemmaRMSNorm``: ``norm(x) * (1 + w)`` scaled in fp32),
the per-head q/k norms and the final norm included. The embedding is scaled by
``sqrt(hidden_size)`` rounded to the model dtype (transformers' ``embed_scale``); the head is
tied by default, and ``final_logit_softcapping`` (``cap * tanh(logits / cap)``) is computed.
Attention scales by ``query_pre_attn_scalar ** -0.5``; ``layer_types`` makes each layer sliding
(its last ``sliding_window`` positions on the positional cache) or full, each type with its
own rope (``rope_parameters`` keyed by layer type: default or linear). The MLP is gated GELU
(``hidden_activation``). ``attn_logit_softcapping`` and ``use_bidirectional_attention`` are
refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..runtime.args import BoundaryRuntime
from ..runtime.embedding import ParallelLMHead, VocabParallelEmbedding
from ..runtime.norm import GemmaRMSNorm
from .base import vocab_embedding
from .head import ScaledEmbedding, ScaledLMHead, embedding_scale
from .config import (BOOL, FULL, POSITIVE_INT, POSITIVE_NUMBER, SLIDING, SLIDING_FIELDS,
                     CheckpointError, layer_windows)
from .layers import GatedMLP, GqaAttention, PostNormDecoderLayer
from .llama import LlamaConfig, LlamaForCausalLM
from .registry import dense, register_model
from .rope import inverse_frequencies
from .settings import PER_HEAD, setting

# hidden_activation -> F.gelu's approximate
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
ROPE_TYPES = ("default", "linear")
# transformers' Gemma3TextConfig defaults, for what a config.json leaves out (beside the
# fields' own)
DEFAULTS = {"sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh"}
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


def read_ropes(cfg: dict) -> dict:
    """{layer type: (rope_theta, linear factor)} as transformers' Gemma-3 config builds them:
    ``rope_parameters`` keyed by layer type (a missing type: the default rope), a legacy
    ``rope_scaling`` applying to the full layers, thetas defaulting to ``rope_theta`` (full)
    and ``rope_local_base_freq`` (sliding), else 1e6 and 1e4."""
    given = cfg.get("rope_parameters") or {}
    per_type = {t: dict(given.get(t) or {"rope_type": "default"}) for t in (SLIDING, FULL)}
    if cfg.get("rope_scaling"):
        per_type[FULL].update(cfg["rope_scaling"])
    fallback = {FULL: cfg.get("rope_theta"), SLIDING: cfg.get("rope_local_base_freq")}
    ropes = {}
    for kind, rope in per_type.items():
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise CheckpointError(f"config.json rope_parameters.{kind} rope_type {rope_type!r} "
                                  f"is not supported ({', '.join(ROPE_TYPES)} only)")
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        if partial is not None and partial != 1:
            raise CheckpointError(f"config.json partial_rotary_factor={partial!r} is not "
                                  "supported (the whole head rotates)")
        theta = rope.get("rope_theta", fallback[kind] or DEFAULT_THETA[kind])
        factor = rope.get("factor") if rope_type == "linear" else 1.0
        for key, value in (("rope_theta", theta), ("factor", factor)):
            if not POSITIVE_NUMBER.ok(value):
                raise CheckpointError(f"config.json rope_parameters.{kind}.{key} must be "
                                      f"{POSITIVE_NUMBER.what}, got {value!r}")
        ropes[kind] = (float(theta), float(factor))
    return ropes


@dataclass(frozen=True)
class Gemma3TextConfig(LlamaConfig):
    head_dim: int = setting(256, derive=PER_HEAD)
    tie_word_embeddings: bool = setting(True)
    mlp_bias: bool = False  # transformers' Gemma-3 has none (config.json's is not read)
    windows: tuple = ()  # each layer's sliding window (None: full)
    ropes: tuple = ()  # each layer's (rope_theta, linear factor)
    query_pre_attn_scalar: float = setting(256.0, POSITIVE_NUMBER)
    final_logit_softcapping: float | None = setting(None, POSITIVE_NUMBER)
    approximate: str = "tanh"  # the MLP's gelu (F.gelu's approximate)
    model_type: str = "gemma3_text"

    checks = {**SLIDING_FIELDS, "attn_logit_softcapping": POSITIVE_NUMBER,
              "use_bidirectional_attention": BOOL, "rope_local_base_freq": POSITIVE_NUMBER,
              "sliding_window_pattern": POSITIVE_INT}

    @classmethod
    def refuse(cls, cfg: dict) -> None:
        if cfg.get("quantization_config"):
            raise CheckpointError("config.json quantization_config is not supported "
                                  "(unquantized checkpoints only)")
        for field in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if cfg.get(field):
                raise CheckpointError(f"config.json {field}={cfg[field]!r} is not supported")
        act = cfg.get("hidden_activation", DEFAULTS["hidden_activation"])
        if act not in ACTIVATIONS:
            raise CheckpointError(f"config.json hidden_activation {act!r} is not supported "
                                  f"({', '.join(ACTIVATIONS)} only)")

    @classmethod
    def read(cls, cfg: dict) -> dict:
        cfg = {**DEFAULTS, **cfg}
        return dict(super().read(cfg), approximate=ACTIVATIONS[cfg["hidden_activation"]])

    @classmethod
    def read_rope_fields(cls, cfg: dict, values: dict) -> dict:
        """Each layer's window and rope (its type's: ``read_ropes``)."""
        pattern = cfg.get("sliding_window_pattern") or 6  # transformers' legacy schedule

        def default_types(n: int) -> list:
            return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]

        windows = layer_windows(cfg, values["num_hidden_layers"], default_types)
        ropes = read_ropes(cfg)
        return {"windows": windows,
                "ropes": tuple(ropes[SLIDING if w is not None else FULL] for w in windows)}

    def layer_frequencies(self, index: int) -> torch.Tensor:
        """Layer ``index``'s rotary inverse frequencies (its type's theta, linear factor)."""
        theta, factor = self.ropes[index]
        return inverse_frequencies(theta, self.head_dim) / factor


class GeluGatedMLP(GatedMLP):
    """``down(gelu(gate(x)) * up(x))``: the gated MLP with GELU (``approximate``: "tanh" or
    "none")."""

    def __init__(self, hidden_size: int, intermediate_size: int, runtime: BoundaryRuntime,
                 dtype, *, approximate: str = "tanh") -> None:
        super().__init__(hidden_size, intermediate_size, runtime, dtype)
        self.approximate = approximate

    def forward(self, x):
        gate = F.gelu(self.gate_proj(x), approximate=self.approximate)
        return self.down_proj(gate * self.up_proj(x))


class Gemma3DecoderLayer(PostNormDecoderLayer):
    """Attention (per-head Gemma q/k norms, PARTIAL) then the gated GELU MLP, each read
    through its input norm and each output through the stage's own post norm before the add
    (``PostNormDecoderLayer`` with input norms)."""

    def __init__(self, cfg: Gemma3TextConfig, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = GqaAttention.of(
            cfg, layer_id, runtime, dtype, bias=cfg.attention_bias, qk_norm_eps=eps,
            qk_norm_cls=GemmaRMSNorm, scaling=cfg.query_pre_attn_scalar ** -0.5,
            inv_freq=cfg.layer_frequencies(layer_id), window=cfg.windows[layer_id])
        self.mlp = GeluGatedMLP(h, cfg.intermediate_size, runtime, dtype,
                                approximate=cfg.approximate)
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype=dtype)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype=dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype=dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype=dtype)
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")

    def read_norms(self) -> tuple:
        return self.input_layernorm, self.pre_feedforward_layernorm


@register_model("gemma3_text", Gemma3TextConfig, architectures=("Gemma3ForCausalLM",), **dense())
class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma-3 (text): sandwich norms (post norms as residual updates), zero-centered norms,
    a scaled embedding, sliding and full layers on a positional cache."""

    layer_cls = Gemma3DecoderLayer

    @staticmethod
    def final_norm(cfg, dtype) -> torch.nn.Module:
        return GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def make_embedding(self, cfg, runtime, dtype) -> VocabParallelEmbedding:
        return vocab_embedding(cfg, runtime, dtype, ScaledEmbedding,
                               scale=embedding_scale(cfg.hidden_size, dtype))

    def make_head(self, cfg, runtime, dtype) -> ParallelLMHead:
        if cfg.final_logit_softcapping is None:
            return super().make_head(cfg, runtime, dtype)
        return vocab_embedding(cfg, runtime, dtype, ScaledLMHead,
                               cap=float(cfg.final_logit_softcapping))
