"""Qwen3-Next (hybrid gated DeltaNet / gated attention, MoE) with layer boundaries.

Every decoder layer is two stages, as in transformers: a token mixer read through
``input_layernorm``, then an FFN read through ``post_attention_layernorm``. ``layer_types``
(or ``full_attention_interval``) picks each layer's mixer:

* ``linear_attention``: the gated DeltaNet (``gated_deltanet.py``), a single-stage SCOPED
  mixer on this attention-DP rank's rows (``declare_attn(reduction=SCOPED,
  gathers_tp_input=False)``, as Nemotron-H's Mamba2), its conv window and recurrent state
  kept per request;
* ``full_attention``: GQA whose ``q_proj`` also yields an output gate (the output is
  ``o_proj(attn * sigmoid(gate))``), zero-centered per-head q/k norms, rotary on the first
  ``partial_rotary_factor`` of each head; a PARTIAL attention (``o_proj`` never reduces).

The FFN is a MoE (softmax top-k routed experts plus a shared expert scaled by
``sigmoid(shared_expert_gate(x))``, whose partial rides on the routed experts' one sum) where
``num_experts > 0``, the layer is not in ``mlp_only_layers`` and ``(i + 1) %
decoder_sparse_step == 0``; a gated MLP otherwise. Every RMSNorm outside the DeltaNet is
zero-centered (``GemmaRMSNorm``: ``norm(x) * (1 + w)`` in fp32), the boundaries' included.

Parameter names follow the checkpoint; q/k/v stack into ``qkv_proj`` and the routed experts
fuse per rank (``experts.w13``/``experts.w2``) at load time. transformers drops the MTP
weights (``mtp.*``) and has no MTP module; they are not loaded here either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .. import ProducerReduction, declare_attn, declare_ffn
from ..runtime import GemmaRMSNorm, QKVParallelLinear, RowParallelLinear
from ..runtime.args import BoundaryRuntime
from ..runtime.hf_names import GATE_UP_EXPERTS, MLP_ROUTER
from .base import CausalLM
from .config import (BOOL, INT_LIST, NON_NEGATIVE_INT, POSITIVE_INT, POSITIVE_NUMBER,
                     CheckedConfig, CheckpointError, check_heads, check_unquantized_silu,
                     require, theta_of)
from .gated_deltanet import GatedDeltaNet, check_heads as check_linear_heads
from .attention import cached_attention
from .kv_cache import CacheLayout, KVCache
from .layers import QKV_PARAMS, DecoderLayer, GatedMLP
from .mamba2 import MambaState
from .moe import UNSHARDED, FusedMoE, expert_stacked_params
from .nemotron_h import HybridCache
from .qwen3_moe import Qwen3MoeRouter
from .registry import NO_QKV_LATENT, register_model
from .rope import apply_rope, forward_cos_sin, inverse_frequencies, rope_key
from .settings import AS_MANY_AS_HEADS, NULL_IS_FALSE, Null, setting

LINEAR, FULL = "linear_attention", "full_attention"


def layer_types(cfg: dict) -> tuple[str, ...]:
    """Each layer's mixer: ``layer_types``, else every ``full_attention_interval``-th layer
    full attention (transformers' default interval 4)."""
    layers = require(cfg, "num_hidden_layers")
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        types = [LINEAR if (i + 1) % interval else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise CheckpointError(f"config.json layer_types must list num_hidden_layers={layers} "
                              f"layer types, got {types!r}")
    bad = sorted(set(types) - {LINEAR, FULL})
    if bad:
        raise CheckpointError(f"config.json layer_types has unsupported types {bad} "
                              f"(supported: {LINEAR}, {FULL})")
    return tuple(types)


def rope_fields(cfg: dict, head_dim: int, default_factor: float = 0.25) -> dict:
    """rope_theta and the rotary dims of a head (``partial_rotary_factor``, default
    ``default_factor``: 0.25 as transformers sets it for Qwen3-Next). Qwen3.5's
    ``mrope_section`` rotates text positions exactly as plain rope (its three position rows
    are equal for text), so it is accepted and unused."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"config.json rope_type {rope_type!r} is not supported "
                              "(default only)")
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor",
                                                        default_factor))
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise CheckpointError(f"config.json partial_rotary_factor={factor} gives {rotary_dim} "
                              f"rotary dims of head_dim={head_dim} (a positive even number "
                              "is needed)")
    return dict(rope_theta=theta_of(rope, cfg, 10000.0),
                rotary_dim=rotary_dim)


@dataclass(frozen=True)
class Qwen3NextConfig(CheckedConfig):
    """The decoder's sizes, each layer's mixer, the fields of each mixer the config has
    (``MIXER_FIELDS``; the others unread), the MoE's where ``num_experts > 0`` and the dense
    MLP's where a layer is dense, with transformers' defaults; ``FIXED``: the fields the
    architecture fixes whatever config.json says (Qwen3.5)."""

    vocab_size: int = setting()
    hidden_size: int = setting()
    layer_types: tuple[str, ...] = ()
    num_attention_heads: int = setting(unread=1)
    num_key_value_heads: int = setting(derive=AS_MANY_AS_HEADS, unread=1)
    head_dim: int = setting(unread=1)
    rotary_dim: int = 2
    rope_theta: float = 10000.0
    attention_bias: bool = setting(False, BOOL)
    linear_num_key_heads: int = setting(check=POSITIVE_INT, unread=1)
    linear_num_value_heads: int = setting(check=POSITIVE_INT, unread=1)
    linear_key_head_dim: int = setting(check=POSITIVE_INT, unread=1)
    linear_value_head_dim: int = setting(check=POSITIVE_INT, unread=1)
    linear_conv_kernel_dim: int = setting(4, POSITIVE_INT)
    intermediate_size: int = setting(unread=0)  # a dense layer's
    num_experts: int = setting(0, NON_NEGATIVE_INT, null=Null.DEFAULT)  # 0: all dense
    num_experts_per_tok: int = setting(unread=0)
    moe_intermediate_size: int = setting(unread=0)
    shared_expert_intermediate_size: int = setting(check=POSITIVE_INT, unread=0)
    norm_topk_prob: bool = setting(True, BOOL, null=Null.DERIVE, derive=NULL_IS_FALSE)
    decoder_sparse_step: int = setting(1, POSITIVE_INT)
    mlp_only_layers: tuple = setting((), INT_LIST)
    rms_norm_eps: float = setting(1e-6)
    tie_word_embeddings: bool = setting(False)
    # the DeltaNet's projections: Qwen3.5's in_proj_qkv/z/b/a, not Qwen3-Next's fused qkvz/ba
    split_projections: bool = False
    model_type: str = "qwen3_next"

    checks = {"routed_scaling_factor": POSITIVE_NUMBER, "full_attention_interval": POSITIVE_INT}
    shared_overrides = {"num_experts": NON_NEGATIVE_INT}  # 0: every layer's FFN is dense
    expert_fields, top_k_fields = ("num_experts",), ("num_experts_per_tok",)
    FIXED: ClassVar[dict] = {}

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    def has(self, kind: str) -> bool:
        return kind in self.layer_types

    def is_sparse(self, layer_id: int) -> bool:
        return (self.num_experts > 0 and 0 <= layer_id < self.num_hidden_layers
                and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def read(cls, cfg: dict) -> dict:
        """A quantized checkpoint and an activation other than silu refused by name, each
        layer's mixer, then the declared settings of the mixers the config has, the rope
        (full attention's) and the linear heads' grouping, the MoE's settings where there
        are experts (``FIXED`` applied) and the dense MLP's where a layer is dense."""
        check_unquantized_silu(cfg)
        types = layer_types(cfg)
        unread = {f for kind, fields in MIXER_FIELDS.items() if kind not in types
                  for f in fields}
        values = super().read(cfg, unread=frozenset(unread | set(MOE_FIELDS)
                                                    | {"intermediate_size"}))
        values.update(layer_types=types, **cls.FIXED)
        if FULL in types:
            values.update(rope_fields(cfg, values["head_dim"]))
        if LINEAR in types and values["linear_num_value_heads"] % values["linear_num_key_heads"]:
            raise CheckpointError(
                f"config.json linear_num_value_heads={values['linear_num_value_heads']} is not "
                f"divisible by linear_num_key_heads={values['linear_num_key_heads']}")
        if values["num_experts"]:
            for name in MOE_FIELDS:
                values[name] = cls.read_setting(cfg, name, values)
            values.update(cls.FIXED)
        config = cls(**values)
        if not all(config.is_sparse(i) for i in range(config.num_hidden_layers)):
            values["intermediate_size"] = cls.read_setting(cfg, "intermediate_size", values)
        return values


# the fields read where the config has layers of a mixer, and where it has experts
MIXER_FIELDS = {
    FULL: ("num_attention_heads", "num_key_value_heads", "head_dim", "attention_bias"),
    LINEAR: ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim", "linear_conv_kernel_dim"),
}
MOE_FIELDS = ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
              "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")


def check_parallel(cfg: Qwen3NextConfig, dims) -> None:
    """Reject a topology this config cannot be sharded over, naming the config field."""
    if cfg.has(FULL):
        check_heads(cfg.num_attention_heads, cfg.num_key_value_heads, dims.attn_tp)
    if cfg.has(LINEAR):
        check_linear_heads(cfg.linear_num_key_heads, cfg.linear_num_value_heads, dims.attn_tp)
    sparse = [cfg.is_sparse(i) for i in range(cfg.num_hidden_layers)]
    if not all(sparse) and cfg.intermediate_size % dims.tp:
        raise ValueError(f"intermediate_size={cfg.intermediate_size} is not divisible by "
                         f"tp={dims.tp}")
    if any(sparse):
        if cfg.num_experts % dims.moe_ep:
            raise ValueError(f"num_experts={cfg.num_experts} is not divisible by "
                             f"ep={dims.moe_ep}")
        if cfg.moe_intermediate_size % dims.moe_tp:
            raise ValueError(f"moe_intermediate_size={cfg.moe_intermediate_size} is not "
                             f"divisible by the MoE tensor-parallel size tp/ep={dims.moe_tp}")
        if cfg.shared_expert_intermediate_size % dims.tp:
            raise ValueError("shared_expert_intermediate_size="
                             f"{cfg.shared_expert_intermediate_size} is not divisible by "
                             f"tp={dims.tp}")


def mixer_declaration(cfg: Qwen3NextConfig, layer_id: int):
    """Layer ``layer_id``'s mixer stage: the DeltaNet SCOPED on its own rows, or a PARTIAL
    gated attention."""
    if cfg.layer_types[layer_id] == LINEAR:
        return declare_attn(reduction=ProducerReduction.SCOPED, gathers_tp_input=False,
                            mixer="gated_deltanet")
    return declare_attn(mixer="gated_attention")  # plans name the pattern layer by layer


def ffn_declaration(cfg: Qwen3NextConfig, layer_id: int, runtime: BoundaryRuntime):
    """Layer ``layer_id``'s FFN stage: the MoE where the layer is sparse, else the gated MLP."""
    sparse = cfg.is_sparse(layer_id)
    return declare_ffn(sparse=sparse, next_sparse=cfg.is_sparse(layer_id + 1),
                       dispatches=sparse and runtime.dispatches_moe)


class Qwen3NextAttention(nn.Module):
    """GQA with an output gate; heads over attention TP (kv heads split or replicated);
    ``index`` is its KV-cache slot; PARTIAL: ``o_proj`` never reduces."""

    def __init__(self, cfg: Qwen3NextConfig, index: int, runtime: BoundaryRuntime, dtype):
        super().__init__()
        group = runtime.parallel.attn_tp_group
        heads, d = cfg.num_attention_heads, cfg.head_dim
        self.index, self.head_dim, self.rotary_dim = index, d, cfg.rotary_dim
        # q_proj's rows are [q_h | gate_h] per head: as 2 * heads "heads" of head_dim they
        # shard head by head, with the kv heads of the real query heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, 2 * heads, cfg.num_key_value_heads,
                                          group, bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = RowParallelLinear(heads * d, cfg.hidden_size, group,
                                        bias=cfg.attention_bias, reduce_results=False,
                                        dtype=dtype, name="o_proj")
        self.q_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.register_buffer("inv_freq", inverse_frequencies(cfg.rope_theta, cfg.rotary_dim),
                             persistent=False)
        self.rope_key = rope_key(self.inv_freq)
        self.scaling = d ** -0.5

    def rope(self, x, cos, sin):
        """Rotary on the first ``rotary_dim`` dims of each head, the rest passed through."""
        rot, rest = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat([apply_rope(rot, cos, sin, interleave=False), rest], dim=-1)

    def forward(self, positions, hidden_states, forward_batch):
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        qg, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        tokens, d = qkv.shape[0], self.head_dim
        heads, kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads  # local
        q, gate = qg.view(tokens, heads, 2 * d).split(d, dim=-1)  # [T, H, D] each
        k = k.view(tokens, kv_heads, d)  # [T, KVH, D]
        v = v.view(tokens, kv_heads, d)
        q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = forward_cos_sin(forward_batch, self.rope_key, positions, self.inv_freq,
                                   q.dtype, full_width=False)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        out = cached_attention(self.index, q, k, v, forward_batch, self.scaling)  # [T, H, D]
        out = out * torch.sigmoid(gate)
        return self.o_proj(out.flatten(1))  # [T, hidden], this rank's partial


class Qwen3NextSparseMoe(nn.Module):
    """Routed experts over ``moe_ep x moe_tp`` plus the shared expert, sharded over TP (whole
    beside dispatched experts), scaled by a replicated ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, cfg: Qwen3NextConfig, runtime: BoundaryRuntime, dtype):
        super().__init__()
        self.gate = Qwen3MoeRouter(cfg, dtype)  # softmax top-k, renormalised by norm_topk_prob
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                runtime.parallel, dtype, dispatch=runtime.dispatches_moe)
        self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size,
                                      runtime, dtype, reduce_results=False,
                                      group=UNSHARDED if runtime.dispatches_moe else None)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False, dtype=dtype)
        self.shared_expert_gate.requires_grad_(False)

    def forward(self, x):
        """x: [T, H]: a partial over TP, a finalize handoff or the complete output, as the
        exit's flags ask; the gated shared expert (a partial, since the gate is per row)
        shares the one sum."""
        weights, ids = self.gate(x)
        gate = torch.sigmoid(self.shared_expert_gate(x))
        shared = gate * self.shared_expert(x)
        return self.experts(x, ids, weights, shared_output=shared)


class Qwen3NextDecoderLayer(DecoderLayer):
    """The mixer stage (``linear_attn`` or ``self_attn``) then the FFN stage (``mlp``), both
    read through zero-centered norms; the mixer's index is its slot among its kind."""

    def __init__(self, cfg: Qwen3NextConfig, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                     dtype=dtype)
        self.kind = cfg.layer_types[layer_id]
        index = cfg.layer_types[:layer_id].count(self.kind)
        if self.kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, index, runtime, dtype)
        else:
            self.self_attn = Qwen3NextAttention(cfg, index, runtime, dtype)
        if cfg.is_sparse(layer_id):
            self.mlp = Qwen3NextSparseMoe(cfg, runtime, dtype)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, runtime, dtype)
        self.attn_compute = "linear_attn" if self.kind == LINEAR else "self_attn"
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        """The layer's mixer (the DeltaNet SCOPED, or the gated attention PARTIAL), then its
        FFN; the stack gives each its real neighbours (a mixer may follow a mixer's layer)."""
        return mixer_declaration(cfg, index), ffn_declaration(cfg, index, runtime)

    def attend(self, positions, hidden_states, forward_batch):
        if self.kind == FULL:
            return super().attend(positions, hidden_states, forward_batch)
        if hidden_states.shape[0] == 0:  # no rows on this DP rank (nor on its attn-TP peers)
            return hidden_states.new_zeros((0, self.hidden_size))
        return self.linear_attn(hidden_states, forward_batch)


# What ``auto`` resolves to for Qwen3-Next, Qwen3.5 and Qwen3.5-MoE, chosen by measurement:
# ``rs+rsv``, chosen per batch. On their tiny checkpoints at tp 4 dp 2 (DP ranks holding 41 and
# 5 prompt tokens; ``bench.path_bytes``) its choice moved the fewest ledger bytes of ar, rs
# and rsv in the prefill (rsv: 168 kB, against 195 kB for ar and 235 kB for rs) and in the
# decode step (rsv: 11.9 kB against 16.3 kB for ar).
AUTO = "rs+rsv"
NO_CP = "a gated DeltaNet state cannot be cut over CP ranks (no state handoff)"
NO_SP = ("its gated DeltaNet mixers consume their own rows, not column- and row-parallel "
         "linears on gathered ones")


@register_model("qwen3_next", Qwen3NextConfig, architectures=("Qwen3NextForCausalLM",),
                check_parallel=check_parallel, moe_a2a=True,
                context_parallel=NO_CP, sequence_parallel=NO_SP, boundary_reduction=AUTO,
                positional_cache=False,  # its recurrent states fold every token in
                attn_input_scattered=NO_QKV_LATENT,
                batch_invariant=True)
class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next: gated DeltaNet and gated-attention mixers in the order ``layer_types``
    gives, each before a MoE (or gated MLP) FFN; zero-centered norms throughout."""

    layer_cls = Qwen3NextDecoderLayer
    # transformers' qwen2_moe conversion: each layer's experts stacked into
    # experts.gate_up_proj and experts.down_proj; the router is no nn.Linear
    transformers_names = (*GATE_UP_EXPERTS, MLP_ROUTER)

    @staticmethod
    def final_norm(cfg, dtype) -> torch.nn.Module:
        return GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)  # zero-centered

    def cache_layout(self) -> CacheLayout:
        """The attention layers' k/v, by their index among the layers of their kind."""
        return CacheLayout.of(layer.self_attn for layer in self.model.layers
                              if layer.kind == FULL)

    def cache_state(self, kv: KVCache, slots: int, max_len: int) -> HybridCache:
        """The DeltaNet layers' conv windows and recurrent states beside the k/v, by their
        index among the layers of their kind."""
        cfg = self.config
        linear = [layer.linear_attn for layer in self.model.layers if layer.kind == LINEAR]
        m = linear[0] if linear else None
        # MambaState's shapes: the [heads, head_dim, state_size] state is [v heads, dk, dv]
        state = MambaState([x.index for x in linear], slots, m.conv_channels if m else 0,
                           cfg.linear_conv_kernel_dim, m.v_heads if m else 0,
                           cfg.linear_key_head_dim, cfg.linear_value_head_dim, self.dtype,
                           device=self.device)
        return HybridCache(kv, state)

    def stacked_params(self) -> list:
        out = []
        if self.config.has(FULL):
            out += QKV_PARAMS
        if self.config.num_experts:
            out += expert_stacked_params(self.config.num_experts)
        return out

    def skipped_params(self) -> tuple:
        # the MTP block (mtp.*): transformers ignores it on load and has no module for it
        return super().skipped_params() + ("mtp.",)
