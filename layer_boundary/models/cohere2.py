"""Cohere2 (Command-R7B, Command-A) with layer boundaries: Cohere's parallel blocks with
sliding and full layers.

Facts from transformers' ``modeling_cohere2`` beyond Cohere's (``cohere.py``): ``layer_types``
makes each layer sliding (its last ``sliding_window`` positions) or full; without it every
``sliding_window_pattern``-th layer (default 4) is full; only the sliding layers rotate q and
k (a full layer applies no rotary embedding); ``head_dim`` is config.json's, else ``hidden_size
// num_attention_heads``. The block, the norms, the head and its ``logit_scale`` are Cohere's.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cohere import NO_SP, CohereConfig, CohereForCausalLM
from .config import FULL, SLIDING, SLIDING_FIELDS, Check, layer_windows
from .registry import dense, register_model

PATTERN = Check(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                "a positive integer")


@dataclass(frozen=True)
class Cohere2Config(CohereConfig):
    windows: tuple = ()  # each layer's sliding window (None: full, and unroped)
    rope_theta: float = 10000.0  # transformers' Cohere2 keeps the base default, not Cohere's
    model_type: str = "cohere2"

    checks = {**CohereConfig.checks, **SLIDING_FIELDS, "sliding_window_pattern": PATTERN}

    @classmethod
    def read(cls, cfg: dict) -> dict:
        cfg = {"sliding_window": 4096, **cfg}  # transformers' default window
        # config.json's head_dim, where given, sets the heads' width (transformers sets it
        # over its derived one), as Cohere's reader reads it; a null one is refused there
        dense = super().read(cfg)
        pattern = cfg.get("sliding_window_pattern", 4)

        def default_types(n: int) -> list:
            """transformers' schedule: every ``pattern``-th layer full."""
            return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]

        windows = layer_windows(cfg, dense["num_hidden_layers"], default_types)
        return dict(dense, windows=windows)

    def layer_window(self, index: int) -> int | None:
        return self.windows[index]

    def layer_rope(self, index: int) -> bool:
        return self.windows[index] is not None  # only the sliding layers are roped


@register_model("cohere2", Cohere2Config, architectures=("Cohere2ForCausalLM",),
                **dense(sequence_parallel=NO_SP))
class Cohere2ForCausalLM(CohereForCausalLM):
    """Cohere2: Cohere's parallel blocks, sliding layers roped and full ones unroped, on a
    positional cache."""
