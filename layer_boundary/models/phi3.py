"""Phi-3 (``Phi3ForCausalLM``) with layer boundaries: Llama's pre-norm decoder (RMSNorm, GQA,
a SiLU-gated MLP) whose checkpoint fuses the projections, following transformers'
``modeling_phi3``:

* ``self_attn.qkv_proj.weight`` is [q; k; v] rows ([heads + 2 * kv_heads] * head_dim, no
  bias) and ``mlp.gate_up_proj.weight`` is [gate; up] rows (2 * intermediate, no bias); each
  loads into the merged linear of its name, a rank reading only its rows of each block
  (``runtime/fused.py``). The MLP is ``down(up * silu(gate))``, gate and up the two halves of
  ``gate_up_proj``'s output.
* the rotary embedding turns the first ``int(head_dim * partial_rotary_factor)`` dims of
  each head (rotate-half over them; the factor from the rope dict, else the top level, else
  1); the default rope type only: ``longrope`` (and its legacy names ``su``/``yarn``) picks
  its short or long factors by the sequence's length and is refused by name.
* ``sliding_window`` (null: none) masks as transformers' sliding-window causal mask does: a
  query at position q sees keys q - sliding_window + 1 .. q. Every layer slides, on the
  positional cache (``GqaAttention(window=)``).
* a rope dict in ``rope_scaling`` wins over ``rope_parameters``, as Phi-3's config reads it;
  ``rms_norm_eps`` defaults to 1e-5; the dropouts (``resid_pdrop``, ``embd_pdrop``,
  ``attention_dropout``) are identities in eval and are not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn

from ..runtime.args import BoundaryRuntime
from ..runtime.fused import load_fused_blocks, use_loader
from ..runtime.linear import ColumnParallelLinear, RowParallelLinear
from .config import POSITIVE_NUMBER, CheckpointError
from .layers import GqaAttention
from .llama import LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM
from .registry import dense, register_model
from .rope import inverse_frequencies
from .settings import setting


def read_rope(cfg: dict) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) as Phi-3's config reads them; rope types other than
    default refused by name."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"config.json rope_type {rope_type!r} is not supported (default "
                              "only; longrope switches its factors by sequence length)")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    for field, value in (("rope_theta", theta), ("partial_rotary_factor", partial)):
        if not POSITIVE_NUMBER.ok(value):
            raise CheckpointError(f"config.json {field} must be {POSITIVE_NUMBER.what}, got "
                                  f"{value!r}")
    return float(theta), float(partial)


@dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    """Llama's dense fields (no biases, the default rope; transformers' Phi-3 defaults), the
    rotary's width and the window."""

    rms_norm_eps: float = setting(1e-5)
    # transformers' Phi-3 has no biases: it reads neither attention_bias nor mlp_bias
    attention_bias: bool = False
    mlp_bias: bool = False
    rotary_dim: int = 0  # the leading dims of each head that rotate
    sliding_window: int | None = setting(None)
    model_type: str = "phi3"

    @classmethod
    def read_rope_fields(cls, cfg: dict, values: dict) -> dict:
        """The theta and the rotary dims of a head (Phi-3's rope dict, partial rotary)."""
        theta, partial = read_rope(cfg)
        head_dim = values["head_dim"]
        rotary_dim = int(head_dim * partial)  # transformers' int(), so the same dims rotate
        if partial > 1 or rotary_dim < 2 or rotary_dim % 2:
            raise CheckpointError(f"config.json partial_rotary_factor={partial!r} rotates "
                                  f"{rotary_dim} of head_dim={head_dim} dims; an even count "
                                  "from 2 to head_dim is supported")
        return {"rope_theta": theta, "rotary_dim": rotary_dim}


class Phi3MLP(nn.Module):
    """``down(up * silu(gate))`` with gate and up in one column-parallel ``gate_up_proj``:
    on each rank its gate rows then its up rows (loaded from the fused tensor), so the two
    halves of its output are this rank's gate and up."""

    def __init__(self, hidden_size: int, intermediate_size: int, runtime: BoundaryRuntime,
                 dtype) -> None:
        super().__init__()
        group = runtime.parallel.tp_group
        self.gate_up_proj = ColumnParallelLinear(hidden_size, 2 * intermediate_size, group,
                                                 dtype=dtype, name="gate_up_proj")
        use_loader(self.gate_up_proj, load_fused_blocks(
            self.gate_up_proj, (intermediate_size, intermediate_size), (0, 1),
            name="mlp.gate_up_proj"))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, group, dtype=dtype,
                                           name="down_proj")

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, 2 * I/tp] -> 2 x [T, I/tp]
        return self.down_proj(up * F.silu(gate))


class Phi3DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with Phi-3's compute: GQA with fused q/k/v, partial rotary and the
    sliding window, then the fused gated MLP over TP."""

    def make_attention(self, cfg: Phi3Config, layer_id: int, runtime: BoundaryRuntime, dtype):
        attn = GqaAttention.of(cfg, layer_id, runtime, dtype, window=cfg.sliding_window,
                               inv_freq=inverse_frequencies(cfg.rope_theta, cfg.rotary_dim),
                               rotary_dim=cfg.rotary_dim)
        qkv = attn.qkv_proj
        q_rows = cfg.num_attention_heads * cfg.head_dim
        kv_rows = cfg.num_key_value_heads * cfg.head_dim
        use_loader(qkv, load_fused_blocks(qkv, (q_rows, kv_rows, kv_rows), ("q", "k", "v"),
                                          name="self_attn.qkv_proj"))
        return attn

    def make_mlp(self, cfg: Phi3Config, layer_id: int, runtime: BoundaryRuntime, dtype):
        return Phi3MLP(cfg.hidden_size, cfg.intermediate_size, runtime, dtype)


@register_model("phi3", Phi3Config, architectures=("Phi3ForCausalLM",), **dense())
class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: Llama's model with the fused checkpoint tensors loaded as they are (nothing
    stacked at load), the window on a positional cache."""

    layer_cls = Phi3DecoderLayer

    def stacked_params(self) -> list:
        return []
