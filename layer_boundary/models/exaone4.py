"""EXAONE-4 with layer boundaries: a post-norm decoder with hybrid sliding-window layers.

Each layer reads the residual as it is (no input norms) and normalises each stage's complete
output with that stage's own norm before the add, as OLMo-2 does (``olmo2.py``: the post-norm
residual kind, ``residual.post_norm.PostNormAdd``)::

    h = x + post_attention_layernorm(attn(x));  out = h + post_feedforward_layernorm(mlp(h))

Its norms are Llama's (round, then scale), its q/k norms per head. ``layer_types`` makes each
layer sliding (its last ``sliding_window`` positions on the positional cache) or full
(transformers' default: every ``sliding_window_pattern``-th layer full); where a sliding
window is configured, the full layers skip the rotary embedding (transformers applies it only
when ``sliding_window`` is null or the layer slides). One rope (default or llama3) for all.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.args import BoundaryRuntime
from ..runtime.norm import RMSNorm
from .config import FULL, SLIDING, SLIDING_FIELDS, Check, CheckpointError, layer_windows
from .layers import GatedMLP, GqaAttention, PostNormDecoderLayer
from .llama import LlamaConfig, LlamaForCausalLM
from .registry import dense, register_model
from .settings import setting

# transformers' Exaone4Config defaults, for what a config.json leaves out
DEFAULTS = {"sliding_window": 4096, "sliding_window_pattern": 4}
PATTERN = Check(lambda v: isinstance(v, (int, str)) and not isinstance(v, bool),
                "an integer or a string")


@dataclass(frozen=True)
class Exaone4Config(LlamaConfig):
    rms_norm_eps: float = setting(1e-5)
    # transformers' EXAONE-4 has no biases: it reads neither attention_bias nor mlp_bias
    attention_bias: bool = False
    mlp_bias: bool = False
    windows: tuple = ()  # each layer's sliding window (None: full)
    ropes: tuple = ()  # each layer: whether it applies the rotary embedding
    model_type: str = "exaone4"

    checks = {**LlamaConfig.checks, **SLIDING_FIELDS, "sliding_window_pattern": PATTERN}

    @classmethod
    def read(cls, cfg: dict) -> dict:
        cfg = {**DEFAULTS, **cfg}
        dense = super().read(cfg)
        window, pattern = cfg.get("sliding_window"), cfg.get("sliding_window_pattern")

        def default_types(n: int) -> list:
            """transformers' schedule: every ``pattern``-th layer full (every layer without a
            window)."""
            if window is None:
                return [FULL] * n
            if not isinstance(pattern, int) or pattern < 1:
                raise CheckpointError(f"config.json sliding_window_pattern={pattern!r} without "
                                      "layer_types is not supported (a positive integer "
                                      "only)")
            return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]

        windows = layer_windows(cfg, dense["num_hidden_layers"], default_types)
        return dict(dense, windows=windows,
                    ropes=tuple(window is None or w is not None for w in windows))


class Exaone4DecoderLayer(PostNormDecoderLayer):
    """Attention (per-head q/k norms; rotary unless the layer is full beside a sliding
    window; PARTIAL) then the gated MLP, each read as the residual is and each output through
    the stage's own post norm before the add (``PostNormDecoderLayer``)."""

    def __init__(self, cfg: Exaone4Config, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = GqaAttention.of(
            cfg, layer_id, runtime, dtype, qk_norm_eps=eps, window=cfg.windows[layer_id],
            inv_freq=cfg.inverse_frequencies() if cfg.ropes[layer_id] else None)
        self.mlp = GatedMLP(h, cfg.intermediate_size, runtime, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype=dtype)
        self.post_feedforward_layernorm = RMSNorm(h, eps, dtype=dtype)
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")


@register_model("exaone4", Exaone4Config, architectures=("Exaone4ForCausalLM",), **dense())
class Exaone4ForCausalLM(LlamaForCausalLM):
    """EXAONE-4: post norms as residual updates, per-head q/k norms, sliding and full
    (unroped) layers on a positional cache; Llama's final norm, head and loading."""

    layer_cls = Exaone4DecoderLayer
