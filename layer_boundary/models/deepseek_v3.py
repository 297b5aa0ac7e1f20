"""DeepSeek-V3 (MLA attention, group-limited sigmoid-routed MoE with shared experts) with layer
boundaries. Compute is plain PyTorch; parameter names follow the Hugging Face checkpoint, except
the routed experts, which are fused per rank (``experts.w13``/``experts.w2``) at load time.

Parallelism:

* MLA over attention TP. The latent projections (``q_a_proj`` or the normalized input itself,
  and ``kv_a_proj_with_mqa``) are replicated and run as the attention stage's
  ``qkv_latent_func``: the boundary applies them on the rows the residual read produces, before
  any row gather, so only the latent moves. ``q_b_proj``/``q_proj`` and ``kv_b_proj`` are
  column-parallel over heads, ``o_proj`` row-parallel without a reduction (PARTIAL contract).
  ``kv_b_proj`` is absorbed into the queries and the output, so the KV cache holds the latent
  (normalized latent + rotated key, one head) rather than every head's keys and values.
* Dense FFN layers (``i < first_k_dense_replace``): a SwiGLU MLP over the full TP group.
* MoE layers: a replicated fp32 router (``gate``), ``FusedMoE`` routed experts over
  ``moe_ep x moe_tp`` and a TP-sharded shared-expert MLP whose partial joins the routed output
  (see ``DeepseekV3MoE.forward`` for how the reductions are shared).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import ProducerReduction, cp_view, declare_attn, declare_ffn
from ..runtime.args import BoundaryRuntime
from ..runtime.context import get_forward
from ..runtime.hf_names import GATE_UP_EXPERTS, MLP_ROUTER
from ..runtime.quant import as_activations, fake_quantize
from ..runtime.linear import ColumnParallelLinear, RowParallelLinear
from ..runtime.norm import RMSNorm
from .base import CausalLM
from .attention import cached_attention
from .kv_cache import CacheLayout
from .layers import DecoderLayer, GatedMLP
from .rope import apply_rope, forward_cos_sin, inverse_frequencies, rope_key
from .config import (BOOL, NON_NEGATIVE_INT, POSITIVE_INT, POSITIVE_NUMBER, CheckedConfig,
                     CheckpointError, check_divisible, check_grouped_router,
                     check_unquantized_silu, fp8_quantization, quantized_read, theta_of)
from .registry import register_model
from .moe import UNSHARDED, FusedMoE, expert_stacked_params, experts_fp8_group
from .settings import NULL_IS_FALSE, Null, setting

# HF builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


def mla_rope(cfg: dict, fp8: bool = False) -> dict:
    """The rope parameters of an MLA config.json (DeepSeek-V3, LongCat-Flash): default rope,
    silu, and unquantized unless ``fp8`` (DeepSeek-V3's block-quantized FP8); anything else is
    rejected naming the field."""
    if cfg.get("rope_parameters"):
        rope, rope_field = cfg["rope_parameters"], "rope_parameters"
    else:
        rope, rope_field = cfg.get("rope_scaling") or {}, "rope_scaling"
    type_key = "rope_type" if "rope_type" in rope or "type" not in rope else "type"
    rope_type = rope.get(type_key, "default")
    if rope_type != "default":
        raise CheckpointError(
            f"config.json {rope_field}.{type_key} {rope_type!r} is not supported (default "
            "only; yarn's frequency and softmax mscale corrections are not implemented)")
    check_unquantized_silu({k: v for k, v in cfg.items()
                            if not (fp8 and k == "quantization_config")})
    return rope


@dataclass(frozen=True)
class DeepseekV3Config(CheckedConfig):
    """The decoder's sizes, the MoE's (routed and shared experts, the grouped router, the
    dense first layers), the MLA's (``q_lora_rank`` None: no q LoRA), the rope's and the FP8
    quantization's."""

    vocab_size: int = setting()
    hidden_size: int = setting()
    intermediate_size: int = setting()
    moe_intermediate_size: int = setting()
    num_hidden_layers: int = setting()
    num_attention_heads: int = setting()
    n_routed_experts: int = setting()
    num_experts_per_tok: int = setting()
    n_shared_experts: int = setting()
    first_k_dense_replace: int = setting(0, NON_NEGATIVE_INT, null=Null.DEFAULT)
    q_lora_rank: int | None = setting(None, POSITIVE_INT)
    kv_lora_rank: int = setting(check=POSITIVE_INT)
    qk_rope_head_dim: int = setting(check=POSITIVE_INT)
    qk_nope_head_dim: int = setting(check=POSITIVE_INT)
    v_head_dim: int = setting(check=POSITIVE_INT)
    norm_topk_prob: bool = setting(True, BOOL, null=Null.DERIVE, derive=NULL_IS_FALSE)
    n_group: int = setting()
    topk_group: int = setting()
    routed_scaling_factor: float = setting(check=POSITIVE_NUMBER)
    rms_norm_eps: float = setting(1e-6)
    rope_theta: float = 10000.0
    rope_interleave: bool = setting(True, null=Null.DERIVE, derive=NULL_IS_FALSE)
    tie_word_embeddings: bool = setting(False)
    attention_bias: bool = setting(False, BOOL)
    # MTP layers stored after the stack; not loaded
    num_nextn_predict_layers: int = setting(0, NON_NEGATIVE_INT, null=Null.DEFAULT)
    # Engine option, never read from config.json: run the shared experts unsharded on every
    # rank and add them after the routed experts' sum (a LOCAL_TAIL FFN stage).
    shared_experts_tp1: bool = False
    # quantization_config (config.fp8_quantization): the FP8 weights' [out, in] block and the
    # modules left unquantized; None: an unquantized checkpoint
    fp8_block: tuple | None = None
    fp8_skip: tuple = ()
    model_type: str = "deepseek_v3"

    expert_fields, top_k_fields = ("n_routed_experts",), ("num_experts_per_tok",)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def q_latent_dim(self) -> int:
        """Width of the q part of the qkv latent (the normalized input without q LoRA)."""
        return self.q_lora_rank if self.q_lora_rank is not None else self.hidden_size

    @property
    def softmax_scale(self) -> float:
        # HF: qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim)^2 only under a
        # non-default rope type, which from_dict rejects
        return self.qk_head_dim ** -0.5

    def is_moe(self, layer: int) -> bool:
        return self.first_k_dense_replace <= layer < self.num_hidden_layers

    @classmethod
    def read(cls, cfg: dict) -> dict:
        """What the model does not compute refused by name (a rope type, a quantization but
        block FP8, an activation, a router but sigmoid's, MoE layers but every one from
        first_k_dense_replace on), then the declared settings, their agreement (as many kv
        heads as heads, the rope's even width, the grouped router) and the rope's theta."""
        rope = mla_rope(cfg, fp8=True)
        block, skip = fp8_quantization(cfg)
        scoring = cfg.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise CheckpointError(f"config.json scoring_func {scoring!r} is not supported "
                                  "(sigmoid only, as transformers' DeepseekV3 router)")
        if cfg.get("moe_layer_freq", 1) != 1:
            raise CheckpointError(f"config.json moe_layer_freq {cfg['moe_layer_freq']!r} is not "
                                  "supported (1 only: every layer from first_k_dense_replace on)")
        values = super().read(cfg)
        heads = values["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != heads:
            raise CheckpointError(f"config.json num_key_value_heads={kv_heads} must equal "
                                  f"num_attention_heads={heads} (MLA expands keys per head)")
        if values["qk_rope_head_dim"] % 2:
            raise CheckpointError(f"config.json qk_rope_head_dim={values['qk_rope_head_dim']} "
                                  "must be even")
        check_grouped_router(*(values[f] for f in ("n_routed_experts", "n_group", "topk_group",
                                                   "num_experts_per_tok")))
        return dict(values, fp8_block=block, fp8_skip=skip,
                    rope_theta=theta_of(rope, cfg, 10000.0))


def check_parallel(cfg: DeepseekV3Config, dims) -> None:
    """Reject a topology this config cannot be sharded over, naming the config field."""
    check_divisible("num_attention_heads", cfg.num_attention_heads, "attention tp", dims.attn_tp)
    check_divisible("n_routed_experts", cfg.n_routed_experts, "moe_ep", dims.moe_ep)
    check_divisible("moe_intermediate_size", cfg.moe_intermediate_size, "moe_tp", dims.moe_tp)
    if cfg.first_k_dense_replace > 0 and cfg.intermediate_size % dims.tp:
        raise ValueError(f"intermediate_size={cfg.intermediate_size} is not divisible by "
                         f"tp={dims.tp}")
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    if cfg.first_k_dense_replace < cfg.num_hidden_layers and shared % dims.tp:
        raise ValueError(f"moe_intermediate_size x n_shared_experts={shared} (shared experts) is "
                         f"not divisible by tp={dims.tp}")


class ReplicatedLinear(nn.Module):
    """y = x @ W.T (+ b) with the full weight on every rank; loads by plain copy."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class DeepseekV3Attention(nn.Module):
    """Multi-head latent attention; heads split over attention TP, PARTIAL output."""

    def __init__(self, cfg: DeepseekV3Config, layer_id: int, runtime: BoundaryRuntime, dtype):
        super().__init__()
        group = runtime.parallel.attn_tp_group
        self.layer_id, self.cfg = layer_id, cfg
        self.num_heads = cfg.num_attention_heads // group.size  # local heads
        bias = cfg.attention_bias
        heads_qk = cfg.num_attention_heads * cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, heads_qk, group, dtype=dtype,
                                               name="q_proj")
        else:
            self.q_a_proj = ReplicatedLinear(cfg.hidden_size, cfg.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, heads_qk, group, dtype=dtype,
                                                 name="q_b_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias, dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = ColumnParallelLinear(
            cfg.kv_lora_rank, cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            group, dtype=dtype, name="kv_b_proj")
        # forward absorbs kv_b_proj's weight into the queries and the output (the cache holds
        # the latent), so it never runs as a linear: an adapter on it could not apply
        self.kv_b_proj.absorbed = "absorbs it into its attention (the cache holds the latent)"
        # PARTIAL output contract: o_proj never reduces; the boundary owns the attn_tp sum.
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.v_head_dim, cfg.hidden_size,
                                        group, bias=bias, reduce_results=False, dtype=dtype,
                                        name="o_proj")
        rope = cfg.qk_rope_head_dim
        self.register_buffer("inv_freq", inverse_frequencies(cfg.rope_theta, rope),
                             persistent=False)
        self.rope_key = rope_key(self.inv_freq)
        self.scaling = cfg.softmax_scale
        self.latent_split = (cfg.q_latent_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim)

    def prepare_qkv_latent(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] normalized input -> [T, q_latent + kv_lora_rank + qk_rope_head_dim].

        Row-wise and identical on every attention-TP rank (replicated weights), so the boundary
        may run it before gathering rows. Without q LoRA the q latent is the input itself:
        ``q_proj`` is head-sharded, and a per-rank head slice must not be gathered over ranks.
        """
        x = as_activations(x)  # an FP8 read's values and scales, dequantized (CPU)
        q = self.q_a_proj(x) if self.cfg.q_lora_rank is not None else x
        return torch.cat((q, self.kv_a_proj_with_mqa(x)), dim=-1)

    def project_q(self, q_lat: torch.Tensor) -> torch.Tensor:
        """q latent -> this rank's heads' queries [T, local heads * qk_head_dim]."""
        if self.cfg.q_lora_rank is None:
            return self.q_proj(q_lat)
        return self.q_b_proj(self.q_a_layernorm(q_lat))

    def latent(self, kv_nope: torch.Tensor) -> torch.Tensor:
        """kv latent -> the normalized latent [T, kv_lora_rank] the cache holds, which
        ``kv_b_proj`` would expand into this rank's heads' keys and values."""
        return self.kv_a_layernorm(kv_nope)

    def forward(self, positions, latent, forward_batch):
        """latent: the attention rows' qkv latent (in a CP batch this CP rank's share of its
        DP rank's tokens); positions: every token's of the DP rank.

        Attention runs on the latent, as engines run MLA (``kv_b_proj`` absorbed): each head's
        query takes the key projection in (q_nope W_k: [T, heads, kv_lora_rank]) and attends
        over one shared head of keys [latent | rotated key] and values (the latent), which is
        what the cache holds (``mla_layout``: kv_lora_rank + qk_rope_head_dim values a
        token, where expanded keys and values take heads x (qk_head_dim + v_head_dim)); the
        value projection then maps each head's latent output to v_head_dim. The scores and
        outputs are those of the expanded form."""
        cfg, cp = self.cfg, cp_view(forward_batch)
        q_lat, kv_nope, k_rot = latent.split(self.latent_split, dim=-1)
        if cp is not None:  # every token's kv latent (not its heads) as keys and values
            kv_nope, k_rot = cp.gather(torch.cat((kv_nope, k_rot), dim=-1)).split(
                (cfg.kv_lora_rank, cfg.qk_rope_head_dim), dim=-1)
        tokens = q_lat.shape[0]
        q = self.project_q(q_lat).view(tokens, self.num_heads, cfg.qk_head_dim)
        q_nope, q_rot = q.split((cfg.qk_nope_head_dim, cfg.qk_rope_head_dim), dim=-1)
        # [local heads * (nope + v), rank] -> [local heads, nope + v, rank]
        w = self.kv_b_proj.weight.view(self.num_heads, -1, cfg.kv_lora_rank)
        w_k, w_v = w.split((cfg.qk_nope_head_dim, cfg.v_head_dim), dim=1)
        q_nope = torch.einsum("thn,hnr->thr", q_nope, w_k)  # [T, h, kv_lora_rank]
        # the forward's tables (a CP share's for the queries), computed by its first layer
        cos, sin = forward_cos_sin(forward_batch, self.rope_key, positions, self.inv_freq,
                                   latent.dtype, None if cp is None else cp.share,
                                   full_width=False)
        q_rot = apply_rope(q_rot, cos, sin, cfg.rope_interleave)
        cos, sin = forward_cos_sin(forward_batch, self.rope_key, positions, self.inv_freq,
                                   latent.dtype, full_width=False)
        k_rot = apply_rope(k_rot[:, None, :], cos, sin, cfg.rope_interleave)  # [T, 1, rope]
        c = self.latent(kv_nope)[:, None, :]  # [T, 1, kv_lora_rank]: one head for all
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((c, k_rot), dim=-1)
        out = cached_attention(self.layer_id, q, k, c, forward_batch, self.scaling,
                               queries=None if cp is None else cp.queries)
        out = torch.einsum("thr,hvr->thv", out, w_v)  # [T, h, v]
        return self.o_proj(out.flatten(1))  # [T, H*Dv] -> [T, hidden] partial over attn_tp


DeepseekV3MLP = GatedMLP  # SwiGLU over the TP group (or ``group``), as the shared block


class DeepseekV3Router(nn.Module):
    """Sigmoid scores; ``e_score_correction_bias`` steers only the choice of experts: the top
    ``topk_group`` groups by the sum of their two best biased scores, then the top-k biased
    scores inside them. Weights are the unbiased scores of the chosen experts, optionally
    normalized, times ``routed_scaling_factor``. Computed and returned in fp32 (HF keeps the
    router in fp32)."""

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        self.top_k, self.num_experts = cfg.num_experts_per_tok, cfg.n_routed_experts
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size,
                                               dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(cfg.n_routed_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64)."""
        scores = F.linear(x.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, self.num_experts)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        topk_ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_weights * self.scale, topk_ids


class DeepseekV3MoE(nn.Module):
    """``fp8_group``: an FP8 checkpoint's routed and shared experts read the input quantized in
    groups of that many channels (``moe.experts_fp8_group``); the router reads it unquantized.
    ``router_cls``: the router a subclass routes with (DeepSeek-V2's softmax one)."""

    router_cls = DeepseekV3Router

    def __init__(self, cfg: DeepseekV3Config, runtime: BoundaryRuntime, dtype,
                 fp8_group: int | None = None):
        super().__init__()
        self.fp8_group = fp8_group
        self.group = runtime.parallel.tp_group
        self.gate = self.router_cls(cfg)
        dispatch = runtime.dispatches_moe
        self.experts = FusedMoE(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                runtime.parallel, dtype, dispatch=dispatch)
        self.tail = cfg.shared_experts_tp1
        # sharded: its partial is summed with the routed experts'; tp1: a replicated tail;
        # beside dispatched experts: whole, on this rank's own rows
        group = UNSHARDED if self.tail or dispatch else None
        self.shared_experts = DeepseekV3MLP(cfg.hidden_size,
                                            cfg.moe_intermediate_size * cfg.n_shared_experts,
                                            runtime, dtype, reduce_results=False, group=group)

    def forward(self, x: torch.Tensor):
        """x: [T, H] (every DP rank's rows). Returns what the exit's flags ask for: a partial
        over the TP group when the boundary owns the sum, a handoff under
        ``defer_moe_finalize``, otherwise the complete output. Sharded shared experts ride
        on the routed experts' reduction (one sum for both)."""
        topk_weights, topk_ids = self.gate(x)
        if self.fp8_group is not None:
            x = fake_quantize(x, self.fp8_group)
        shared = self.shared_experts(x)
        if not self.tail:
            return self.experts(x, topk_ids, topk_weights, shared_output=shared)
        # LOCAL_TAIL: added after the sum; when the sum is left to the boundary (or to a
        # finalize handoff), exactly one rank carries the tail into it
        flags = get_forward()
        deferred = flags.skips_reduction or flags.defer_moe_finalize
        if deferred and self.group.rank != 0:
            shared = None
        routed = self.experts(x, topk_ids, topk_weights,
                              shared_output=shared if deferred else None)
        return routed if deferred else routed + shared


class DeepseekV3DecoderLayer(DecoderLayer):
    """One decoder layer. Index ``num_hidden_layers`` is the multi-token-prediction (NextN)
    block stored after the stack, built in a stack of its own (it enters it and ends it);
    MoE where the model has MoE layers (``moe_cls``: the MoE block a subclass builds)."""

    moe_cls = DeepseekV3MoE

    def __init__(self, cfg: DeepseekV3Config, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = DeepseekV3Attention(cfg, layer_id, runtime, dtype)
        nextn = layer_id >= cfg.num_hidden_layers
        self.is_moe = _is_moe(cfg, layer_id)
        if self.is_moe:
            self.mlp = self.moe_cls(cfg, runtime, dtype, experts_fp8_group(
                cfg, layer_id, cfg.n_routed_experts, shared=True))
        else:
            self.mlp = DeepseekV3MLP(cfg.hidden_size, cfg.intermediate_size, runtime, dtype)
        self.connect(cfg, layer_id, runtime, fusions=fusions,
                     attn_options={"qkv_latent_func": self.self_attn.prepare_qkv_latent},
                     name=f"nextn{layer_id}" if nextn else f"layer{layer_id}")

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        """MLA (PARTIAL; its qkv latent runs on compute rows, before the gather in
        input-scattered batches), then the dense MLP or the MoE."""
        latent_in = (("self_attn.q_a_proj",) if cfg.q_lora_rank is not None
                     else ("self_attn.q_proj",)) + ("self_attn.kv_a_proj_with_mqa",)
        attn = declare_attn(read=quantized_read(cfg, index, latent_in))
        return attn, ffn_declaration(cfg, index, runtime)


def _is_moe(cfg: DeepseekV3Config, layer: int) -> bool:
    """Layer ``layer`` (the NextN block at ``num_hidden_layers``: MoE where the model has MoE
    layers) holds a MoE."""
    if layer >= cfg.num_hidden_layers:
        return cfg.first_k_dense_replace < cfg.num_hidden_layers
    return cfg.is_moe(layer)


def mla_layout(cfg, layers) -> CacheLayout:
    """The latent cache of MLA layers ``layers``: one head a token, keys [normalized latent |
    rotated key], values the keys' latent (stored once); the same on every attention-TP rank."""
    return CacheLayout(dict.fromkeys(layers, (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)),
                       values_from_keys=cfg.kv_lora_rank)


def ffn_declaration(cfg: DeepseekV3Config, layer: int, runtime: BoundaryRuntime):
    """Layer ``layer``'s FFN declaration (the NextN block's at ``num_hidden_layers``)."""
    moe = _is_moe(cfg, layer)
    dispatch = moe and runtime.dispatches_moe
    # beside dispatched experts the tail is part of the complete output: nothing follows it
    tail = cfg.shared_experts_tp1 and moe and not dispatch
    last = layer + 1 >= cfg.num_hidden_layers
    return declare_ffn(sparse=moe, next_sparse=None if last else cfg.is_moe(layer + 1),
                       # an FP8 checkpoint's dense MLPs read quantized inputs; a MoE's router
                       # reads the unquantized one, so its experts quantize it (DeepseekV3MoE)
                       read=None if moe else quantized_read(
                           cfg, layer, ("mlp.gate_proj", "mlp.up_proj")),
                       reduction=ProducerReduction.LOCAL_TAIL if tail else ProducerReduction.SCOPED,
                       dispatches=dispatch)


NO_SP = ("its MLA latent projections are replicated over attention TP, not column-parallel "
         "linears (its latent moves under --attn-input-scattered instead)")


@register_model("deepseek_v3", DeepseekV3Config, architectures=("DeepseekV3ForCausalLM",),
                check_parallel=check_parallel, sequence_parallel=NO_SP,
                attn_input_scattered=True, moe_a2a=True, boundary_reduction="rs+rsv",
                positional_cache=True, context_parallel=True, batch_invariant=True)
class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3: MLA attention, grouped-router MoE after ``first_k_dense_replace`` dense
    layers, and NextN layers a draft may use."""

    layer_cls = DeepseekV3DecoderLayer
    # transformers stacks each layer's experts (gate_up_proj, down_proj); the router is no Linear
    transformers_names = (*GATE_UP_EXPERTS, MLP_ROUTER)

    @staticmethod
    def nextn_layers(cfg: DeepseekV3Config) -> int:
        return cfg.num_nextn_predict_layers

    def cache_layout(self) -> CacheLayout:
        return mla_layout(self.config, self.stage.layers)

    def stacked_params(self) -> list:
        cfg = self.config
        if cfg.first_k_dense_replace >= cfg.num_hidden_layers:
            return []
        return expert_stacked_params(cfg.n_routed_experts)

    def skipped_params(self) -> tuple:  # the NextN layers, stored after the stack
        cfg = self.config
        return super().skipped_params() + tuple(
            f"model.layers.{cfg.num_hidden_layers + j}."
            for j in range(cfg.num_nextn_predict_layers))
