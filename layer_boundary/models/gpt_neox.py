"""GPT-NeoX (Pythia) with layer boundaries: a parallel block read through two norms.

Facts from transformers' ``modeling_gpt_neox``: with ``use_parallel_residual`` (the default)
a layer is ``x + attn(input_layernorm(x)) + mlp(post_attention_layernorm(x))``, else the
sequential ``h = x + attn(input_layernorm(x)); h + mlp(post_attention_layernorm(h))``; the
norms are ``nn.LayerNorm`` with bias, as is ``final_layer_norm``; ``query_key_value`` holds q,
k and v per head (heads-major, [heads, (q, k, v), head_dim]), with ``attention_bias`` on it and
on ``dense``; the rotary embedding turns the first ``partial_rotary_factor`` of each head
(``rotary_pct`` in older configs, default 0.25) in the rotate-half form, the rest passes
through; the MLP is ``dense_4h_to_h(gelu(dense_h_to_4h(x)))`` with biases; the head is
untied by default, stored as ``embed_out`` (transformers' ``lm_head``; a checkpoint holding
``lm_head.weight`` too is read as transformers reads it: ``embed_out``, also for the check of
a tied config against the embedding).

The parallel layer is two stages, a PARTIAL attention and an FFN declared ``parallel=True``
with its own norm, so the attention's partial joins the MLP's sum: one collective a layer
(``parallel_block.py``). The fused ``query_key_value`` loads with ``runtime.fused.load_per_head``,
each rank reading only its heads' rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import declare_attn, declare_ffn
from ..runtime.args import BoundaryRuntime
from ..runtime.fused import load_per_head, use_loader
from ..runtime.hf_names import Rename
from ..runtime.linear import ColumnParallelLinear, RowParallelLinear
from ..runtime.norm import LayerNorm
from .base import CausalLM
from .config import (BOOL, FRACTION, POSITIVE_NUMBER, CheckpointError, check_tp, default_rope,
                     require)
from .layers import DecoderLayer, GqaAttention
from .registry import PARALLEL_BLOCK_DP, dense, register_model
from .rope import inverse_frequencies
from .settings import DecoderConfig, setting

# hidden_act -> F.gelu's approximation (transformers' gelu is exact; gelu_new the tanh form)
GELUS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
NO_SP = "its parallel blocks join the attention's partial to the MLP's sum on unscattered rows"
# what older checkpoints hold beside the weights: attention mask buffers, the rotary table
BUFFERS = re.compile(r"\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)$")
NAMES = (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.layers.", "model.layers."),
         ("gpt_neox.final_layer_norm.", "model.norm."), ("embed_out.", "lm_head."),
         (".attention.query_key_value.", ".self_attn.qkv_proj."),
         (".attention.dense.", ".self_attn.o_proj."))


@dataclass(frozen=True)
class GPTNeoXConfig(DecoderConfig):
    """The dense decoder's sizes (multi-head attention: as many kv heads as heads, each
    ``hidden_size / num_attention_heads`` wide, config.json's head counts beyond those not
    read), the partial rotary (``rotary_dim``, with its theta), the MLP's gelu and the
    parallel block's flag."""

    num_key_value_heads: int = 0  # as many as heads (set by read)
    head_dim: int = 0  # hidden_size / num_attention_heads (set by read)
    rotary_dim: int = 0
    layer_norm_eps: float = setting(1e-5)
    rope_theta: float = 10000.0
    approximate: str = "none"
    use_parallel_residual: bool = setting(True, BOOL)
    attention_bias: bool = setting(True, BOOL)
    tie_word_embeddings: bool = setting(False)
    model_type: str = "gpt_neox"

    # rotary_pct and rotary_emb_base: NeoX's own names for the rotary fraction and theta
    checks = {"rotary_pct": FRACTION, "rotary_emb_base": POSITIVE_NUMBER}

    @classmethod
    def read(cls, cfg: dict) -> dict:
        """A quantized checkpoint, an activation F.gelu does not compute and a rotary that
        turns no even part of a head refused by name, then the declared settings and the
        rotary."""
        if cfg.get("quantization_config"):
            raise CheckpointError("config.json quantization_config is not supported "
                                  "(unquantized checkpoints only)")
        act = cfg.get("hidden_act", "gelu")
        if act not in GELUS:
            raise CheckpointError(f"config.json hidden_act {act!r} is not supported "
                                  f"({', '.join(GELUS)} only)")
        rope = default_rope(cfg)
        heads, hidden = require(cfg, "num_attention_heads"), require(cfg, "hidden_size")
        if hidden % heads:
            raise CheckpointError(f"config.json hidden_size={hidden} is not divisible by "
                                  f"num_attention_heads={heads}")
        head_dim = hidden // heads
        factor = rope.get("partial_rotary_factor", cfg.get("rotary_pct", 0.25))
        if not POSITIVE_NUMBER.ok(factor) or factor > 1:
            raise CheckpointError(f"config.json partial_rotary_factor must be in (0, 1], got "
                                  f"{factor!r}")
        rotary = int(head_dim * factor)
        if rotary < 2 or rotary % 2:
            raise CheckpointError(f"config.json partial_rotary_factor={factor} turns {rotary} "
                                  f"of {head_dim} head dims; an even number of at least 2 is "
                                  "needed")
        theta = rope.get("rope_theta", cfg.get("rotary_emb_base", 10000.0))
        return dict(super().read(cfg), num_key_value_heads=heads, head_dim=head_dim,
                    rotary_dim=rotary, rope_theta=float(theta), approximate=GELUS[act])


def check_parallel(cfg: GPTNeoXConfig, dims) -> None:
    """Heads over attention TP, ``intermediate_size`` over TP."""
    check_tp(cfg, dims.attn_tp, dims.tp)


class GPTNeoXMLP(nn.Module):
    """``dense_4h_to_h(gelu(dense_h_to_4h(x)))`` with biases, its inner dim over TP."""

    def __init__(self, cfg: GPTNeoXConfig, runtime: BoundaryRuntime, dtype) -> None:
        super().__init__()
        group = runtime.parallel.tp_group
        self.dense_h_to_4h = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, group,
                                                  bias=True, dtype=dtype, name="dense_h_to_4h")
        self.dense_4h_to_h = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, group,
                                               bias=True, dtype=dtype, name="dense_4h_to_h")
        self.approximate = cfg.approximate

    def forward(self, x):
        h = F.gelu(self.dense_h_to_4h(x), approximate=self.approximate)
        return self.dense_4h_to_h(h)


class GPTNeoXLayer(DecoderLayer):
    """Attention (fused per-head q/k/v, partial rotary, PARTIAL) and the MLP, each read
    through its own LayerNorm: of the same residual (a parallel block), or sequentially."""

    def __init__(self, cfg: GPTNeoXConfig, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__(cfg.hidden_size, cfg.layer_norm_eps, dtype, input_norms=False)
        h, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.input_layernorm = LayerNorm(h, eps, dtype=dtype)
        self.post_attention_layernorm = LayerNorm(h, eps, dtype=dtype)
        self.self_attn = GqaAttention(
            h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, layer_id,
            runtime, dtype, bias=cfg.attention_bias, rotary_dim=cfg.rotary_dim,
            inv_freq=inverse_frequencies(cfg.rope_theta, cfg.rotary_dim))
        qkv = self.self_attn.qkv_proj
        use_loader(qkv, load_per_head(qkv, name=f"gpt_neox.layers.{layer_id}.attention."
                                                "query_key_value"))
        self.mlp = GPTNeoXMLP(cfg, runtime, dtype)
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        return declare_attn(), declare_ffn(parallel=cfg.use_parallel_residual)


def _head_as_transformers_reads_it(weights):
    """The checkpoint's tensors, its head as transformers reads it: ``embed_out`` and
    ``lm_head`` are both its ``lm_head``, and where a checkpoint holds both, the first in its
    order, ``embed_out``, is loaded: a ``lm_head.weight`` after it is dropped, and one before it
    is loaded over by it."""
    seen = False
    for name, tensor in weights:
        if name == "lm_head.weight" and seen:
            continue
        seen |= name == "embed_out.weight"
        yield name, tensor


@register_model("gpt_neox", GPTNeoXConfig, architectures=("GPTNeoXForCausalLM",),
                **dense(check_parallel=check_parallel, sequence_parallel=NO_SP))
class GPTNeoXForCausalLM(CausalLM):
    """Pythia: parallel blocks with two LayerNorms, partial rotary, biases, fused per-head
    q/k/v, an untied head."""

    layer_cls = GPTNeoXLayer
    # transformers' GPTNeoXForCausalLM conversion: its head is lm_head; where a checkpoint
    # holds embed_out and lm_head both, embed_out (first in its order) is the one it reads
    transformers_names = (Rename(r"^embed_out\.", "lm_head."),)
    batch_invariant_dp = PARALLEL_BLOCK_DP  # (a tp 2 dp 2 request: 1e-6 apart on DP rank 1)

    @classmethod
    def batch_invariant_layout(cls, cfg, dims) -> str | None:
        # sequential blocks (use_parallel_residual false) add nothing before the sum
        return super().batch_invariant_layout(cfg, dims) if cfg.use_parallel_residual else None

    @staticmethod
    def final_norm(cfg, dtype) -> torch.nn.Module:
        return LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)

    def checkpoint_name(self, name: str) -> str | None:
        if BUFFERS.search(name):
            return None
        for theirs, ours in NAMES:
            name = name.replace(theirs, ours)
        return name

    def load_weights(self, weights) -> None:
        super().load_weights(_head_as_transformers_reads_it(weights))
