"""DeepSeek-V4 (sliding-window MQA with attention sinks, grouped output projection, hash and
top-k routed MoE, mHC residual streams) with layer boundaries. Compute is plain PyTorch;
parameter names follow transformers' modules (``self_attn.q_a_proj``, ``mlp.gate``,
``attn_hc.fn``, ...), except the routed experts, which are fused per rank
(``mlp.experts.w13``/``w2``) at load time. ``load_weights`` maps the on-disk names (the
original DeepSeek ones: ``attn.wq_a``, ``ffn.experts.N.w1``, ``hc_attn_fn``, ``head.weight``)
onto them.

Only ``sliding_attention`` layers are supported; the compressed layer types (CSA / HCA, with
their compressor and indexer) are rejected at config time (``deepseek_v4_config.py``).

Residual: ``hc_mult`` streams per token. Each stage reads through its own ``HyperConnection``
(``residual.mhc``): the boundary applies the nonlinear mHC update and read, so the forward is
the ordinary prepare/finish/exit one; the stack ends in ``MhcFinalNorm`` (HyperHead collapse,
then the final RMSNorm).

Parallelism:

* Attention over attention TP: q heads split (``q_b_proj`` column-parallel), the single
  K=V head replicated. The latent projections (``q_a_proj`` and ``kv_proj``) are replicated
  and run as the stage's ``qkv_latent_func``, before any row gather. The grouped output
  projection splits by groups (``o_groups`` divisible by attention TP, each rank holding the
  groups of its heads); ``o_b_proj`` is row-parallel over the group outputs without a
  reduction (PARTIAL contract). Sinks are sliced with the heads.
* MoE (every layer): a replicated fp32 router (``hash_moe``: experts from
  ``tid2eid[token id]``; ``moe``: top-k of the scores plus ``e_score_correction_bias``),
  clamped-SwiGLU routed experts in ``FusedMoE`` over ``moe_ep x moe_tp`` and a TP-sharded
  shared expert whose partial joins the routed output's one sum.

The MoE runs on the FFN stage's compute rows, which are every attention-DP rank's rows in DP
rank order in every row mode (the boundary gathers them). A hash layer needs the token ids of
those rows: ``ffn_token_ids`` moves this rank's ids with the table's movement from local rows
to the stage's compute rows, once per forward.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from .. import declare_attn, declare_ffn
from ..residual.mhc import MHC_UPDATE, HyperConnection, HyperHead, MhcFinalNorm, mhc_stage
from ..runtime.args import BoundaryRuntime
from ..runtime.hf_names import MLP_ROUTER, Rename, StackExperts
from ..runtime.linear import ColumnParallelLinear, RowParallelLinear, expect_shape
from ..runtime.norm import RMSNorm, unweighted_rms
from .base import CausalLM
from .config import CheckpointError
from .deepseek_v3 import DeepseekV3MLP, ReplicatedLinear
from .deepseek_v4_config import SCORING, DeepseekV4Config, check_parallel  # noqa: F401
from .attention import cached_attention
from .kv_cache import CacheLayout
from .layers import DecoderLayer
from .registry import NO_QKV_LATENT, register_model
from .moe import UNSHARDED, FusedMoE, expert_stacked_params
from .rope import forward_cos_sin, inverse_frequencies, rope_key

def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of x [T, H, D]: pairs
    (x0, x1), (x2, x3), ... rotate and stay where they are (not de-interleaved as
    ``rope.apply_rope`` lays them out), since the attention output's rope channels feed the
    output projection in the checkpoint's layout.
    Computed in fp32 and rounded once, as transformers. ``sin`` negated undoes it."""
    rope = 2 * cos.shape[-1]
    nope, rot = x[..., :-rope], x[..., -rope:].float()
    cos, sin = cos[:, None, :].float(), sin[:, None, :].float()  # [T, 1, rope/2]
    even, odd = rot[..., 0::2], rot[..., 1::2]
    rot = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rot.to(x.dtype)), dim=-1)


class DeepseekV4Attention(nn.Module):
    """Sliding-window MQA (one K=V head) with sinks; heads split over attention TP, PARTIAL
    output."""

    def __init__(self, cfg: DeepseekV4Config, layer_id: int, runtime: BoundaryRuntime, dtype):
        super().__init__()
        group = runtime.parallel.attn_tp_group
        self.layer_id, self.cfg = layer_id, cfg
        self.num_heads = cfg.num_attention_heads // group.size  # local heads
        self.groups = cfg.o_groups // group.size  # local output groups
        eps = cfg.rms_norm_eps
        self.q_a_proj = ReplicatedLinear(cfg.hidden_size, cfg.q_lora_rank, dtype=dtype)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, eps, dtype=dtype)
        self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank,
                                             cfg.num_attention_heads * cfg.head_dim, group,
                                             dtype=dtype, name="q_b_proj")
        self.kv_proj = ReplicatedLinear(cfg.hidden_size, cfg.head_dim, dtype=dtype)
        self.kv_norm = RMSNorm(cfg.head_dim, eps, dtype=dtype)
        # o_a_proj: one [o_lora_rank, heads/groups * head_dim] block per group, stacked on the
        # output dim; a column split over ranks holds each rank's whole groups
        per_group = cfg.num_attention_heads * cfg.head_dim // cfg.o_groups
        self.o_a_proj = ColumnParallelLinear(per_group, cfg.o_groups * cfg.o_lora_rank, group,
                                             dtype=dtype, name="o_a_proj")
        # its weight runs group by group in one product (forward), never as this linear
        self.o_a_proj.absorbed = "applies its weight group by group in one product"
        # PARTIAL output contract: o_b_proj never reduces; the boundary owns the attn_tp sum
        self.o_b_proj = RowParallelLinear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, group,
                                          reduce_results=False, dtype=dtype, name="o_b_proj")
        # one sink logit per head (fp32, as transformers keeps it): this rank's heads' slice
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32),
                                  requires_grad=False)
        self.sinks.weight_loader = self._head_slice_loader
        self.rank, self.tp = group.rank, group.size
        self.register_buffer("inv_freq", inverse_frequencies(cfg.rope_theta, cfg.rope_head_dim),
                             persistent=False)
        self.rope_key = rope_key(self.inv_freq)
        self.latent_split = (cfg.q_lora_rank, cfg.head_dim)

    def _head_slice_loader(self, param, loaded: torch.Tensor) -> None:
        expect_shape(loaded, self.num_heads * self.tp)  # every head's sink
        param.data.copy_(loaded.narrow(0, self.rank * self.num_heads, self.num_heads))

    def prepare_qkv_latent(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] normalized input -> [T, q_lora_rank + head_dim]: the q latent and the
        K=V head. Row-wise and replicated, so the boundary runs it before gathering rows."""
        return torch.cat((self.q_a_proj(x), self.kv_proj(x)), dim=-1)

    def forward(self, positions, latent, forward_batch):
        cfg, tokens = self.cfg, latent.shape[0]
        q_lat, kv = latent.split(self.latent_split, dim=-1)
        q = self.q_b_proj(self.q_a_norm(q_lat)).view(tokens, self.num_heads, cfg.head_dim)
        q = unweighted_rms(q, cfg.rms_norm_eps)  # per head
        cos, sin = forward_cos_sin(forward_batch, self.rope_key, positions, self.inv_freq,
                                   latent.dtype, full_width=False)
        q = rope_tail(q, cos, sin)
        kv = rope_tail(self.kv_norm(kv)[:, None, :], cos, sin)  # [T, 1, head_dim]
        out = cached_attention(self.layer_id, q, kv, kv, forward_batch, cfg.softmax_scale,
                               sinks=self.sinks)  # [T, H, head_dim]
        # values carry the rope of their own positions: rotate the output back by the query's
        out = rope_tail(out, cos, -sin)
        out = out.reshape(tokens, self.groups, -1)  # [T, G, heads/G * head_dim]
        w = self.o_a_proj.weight.view(self.groups, cfg.o_lora_rank, -1)  # [G, o_lora, in]
        out = torch.einsum("tgi,goi->tgo", out, w).flatten(1)  # [T, G * o_lora]
        return self.o_b_proj(out)  # [T, hidden], partial over attn_tp


class DeepseekV4MLP(DeepseekV3MLP):
    """The shared expert: a clamped SwiGLU MLP over the TP group, left unreduced (its partial
    joins the routed experts' one sum)."""

    def __init__(self, cfg: DeepseekV4Config, runtime: BoundaryRuntime, dtype):
        # beside dispatched experts: whole, on this rank's own rows
        super().__init__(cfg.hidden_size, cfg.moe_intermediate_size, runtime, dtype,
                         reduce_results=False,
                         group=UNSHARDED if runtime.dispatches_moe else None)
        self.limit = cfg.swiglu_limit

    def forward(self, x):
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(-self.limit, self.limit)
        return self.down_proj(F.silu(gate) * up)


class DeepseekV4Router(nn.Module):
    """Scores ``scoring_func(x @ W.T)`` in fp32. ``hash_moe``: the experts are the token's
    ``tid2eid`` row; ``moe``: the top-k of the scores plus ``e_score_correction_bias`` (the bias
    steers only the choice). Weights are the chosen scores normalised, x
    ``routed_scaling_factor`` (transformers normalises whatever ``norm_topk_prob`` says)."""

    def __init__(self, cfg: DeepseekV4Config, hashed: bool):
        super().__init__()
        self.top_k, self.hashed = cfg.num_experts_per_tok, hashed
        self.score, self.scale = SCORING[cfg.scoring_func], cfg.routed_scaling_factor
        experts = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(experts, cfg.hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        if hashed:
            self.tid2eid = nn.Parameter(torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long),
                                        requires_grad=False)
        else:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None):
        """x: [T, H], token_ids: [T] (hash layers) -> (weights [T, k] fp32, ids [T, k])."""
        scores = self.score(F.linear(x.float(), self.weight))  # [T, E]
        if self.hashed:
            topk_ids = self.tid2eid[token_ids]
        else:
            choice = scores + self.e_score_correction_bias
            topk_ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, topk_ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, topk_ids


class DeepseekV4MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_id: int, runtime: BoundaryRuntime, dtype):
        super().__init__()
        self.is_hash = cfg.is_hash(layer_id)
        self.gate = DeepseekV4Router(cfg, self.is_hash)
        self.experts = FusedMoE(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                runtime.parallel, dtype, swiglu_limit=cfg.swiglu_limit,
                                dispatch=runtime.dispatches_moe)
        self.shared_experts = DeepseekV4MLP(cfg, runtime, dtype)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None):
        """x: [T, H] (every DP rank's rows), token_ids: [T] their ids (hash layers). Returns
        what the exit's flags ask for, the shared expert riding on the routed sum."""
        topk_weights, topk_ids = self.gate(x, token_ids)
        return self.experts(x, topk_ids, topk_weights, shared_output=self.shared_experts(x))


def ffn_token_ids(boundary, forward_batch) -> torch.Tensor:
    """The token ids of ``boundary``'s compute rows (after its prepare()): this rank's ids
    moved from local rows as the table moves any complete value there (a gather over
    attention DP in DP rank order, or nothing). Every FFN stage computes on the same rows, so
    the first hash layer of a forward moves them and the others reuse them (the boundary
    keeps what it moved for the forward)."""
    return boundary.to_compute_rows(forward_batch.input_ids, forward_batch)


class DeepseekV4DecoderLayer(DecoderLayer):
    def __init__(self, cfg: DeepseekV4Config, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = DeepseekV4Attention(cfg, layer_id, runtime, dtype)
        self.mlp = DeepseekV4MoE(cfg, layer_id, runtime, dtype)
        hc = (cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)  # fp32
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}",
                     attn_options={"qkv_latent_func": self.self_attn.prepare_qkv_latent})

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        """The attention, then the MoE; each reads the mHC streams through its own
        hyper-connection and updates them with the (nonlinear, stateless) mHC update. A
        neighbour's declaration (``layer`` None) carries the update only: its read runs on
        its own rank."""
        if layer is None:
            attn_mhc = ffn_mhc = {"update": MHC_UPDATE}
        else:
            attn_mhc, ffn_mhc = mhc_stage(layer.attn_hc), mhc_stage(layer.ffn_hc)
        return (declare_attn(**attn_mhc),
                declare_ffn(sparse=True, dispatches=runtime.dispatches_moe, **ffn_mhc))

    def feed_forward(self, hidden_states, forward_batch):
        ids = ffn_token_ids(self.ffn_boundary, forward_batch) if self.mlp.is_hash else None
        return self.mlp(hidden_states, ids)


# on-disk (original DeepSeek) names -> this model's, per decoder layer; applied in order to
# the name after ``layers.N.``. Names already in transformers' form pass unchanged.
_LAYER_RENAMES = [(re.compile(p), r) for p, r in (
    (r"^attn\.wq_a\.", "self_attn.q_a_proj."),
    (r"^attn\.q_norm\.", "self_attn.q_a_norm."),
    (r"^attn\.wq_b\.", "self_attn.q_b_proj."),
    (r"^attn\.wkv\.", "self_attn.kv_proj."),
    (r"^attn\.norm\.", "self_attn.kv_norm."),
    (r"^attn\.wo_a\.", "self_attn.o_a_proj."),
    (r"^attn\.wo_b\.", "self_attn.o_b_proj."),
    (r"^attn\.attn_sink$", "self_attn.sinks"),
    (r"^attn_norm\.", "input_layernorm."),
    (r"^ffn_norm\.", "post_attention_layernorm."),
    (r"^hc_(attn|ffn)_(fn|base|scale)$", r"\1_hc.\2"),
    (r"^ffn\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"^ffn\.(experts\.\d+|shared_experts)\.w1\.", r"mlp.\1.gate_proj."),
    (r"^ffn\.(experts\.\d+|shared_experts)\.w2\.", r"mlp.\1.down_proj."),
    (r"^ffn\.(experts\.\d+|shared_experts)\.w3\.", r"mlp.\1.up_proj."),
    (r"^ffn\.", "mlp."),
)]
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
HEAD_PREFIX, NORM_PREFIX = "model.norm.head", "model.norm.norm"  # inside MhcFinalNorm
_HEAD = re.compile(r"^(?:model\.hc_head\.|hc_head_)(hc_)?(fn|base|scale)$")
# transformers' deepseek_v4 conversion, by its effect: the original names (unprefixed, or under
# model.) as its parameters; each layer's experts' w1 (gate) and w3 (up) stacked into
# experts.gate_up_proj, their w2 into experts.down_proj; the router is no nn.Linear
TRANSFORMERS_NAMES = (
    *(Rename(p, r) for p, r in (
        (r"^embed\.weight$", "model.embed_tokens.weight"), (r"^head\.weight$", "lm_head.weight"),
        (r"^norm\.weight$", "model.norm.weight"),
        (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"), (r"^layers\.", "model.layers."),
        (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."),
        (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
        (r"\.self_attn\.attn_sink$", ".self_attn.sinks"),
        (r"\.self_attn\.norm\.", ".self_attn.kv_norm."),
        (r"\.self_attn\.q_norm\.", ".self_attn.q_a_norm."),
        (r"\.self_attn\.wq_a\.", ".self_attn.q_a_proj."),
        (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
        (r"\.self_attn\.wkv\.", ".self_attn.kv_proj."),
        (r"\.self_attn\.wo_a\.", ".self_attn.o_a_proj."),
        (r"\.self_attn\.wo_b\.", ".self_attn.o_b_proj."),
        (r"\.mlp\.gate\.bias$", ".mlp.gate.e_score_correction_bias"),
        (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
        (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
        (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."))),
    StackExperts(("w1", "w3"), "gate_up_proj"), StackExperts(("w2",), "down_proj"), MLP_ROUTER)


NO_CP = "its sliding window and sinks across a CP cut are not built"
NO_SP = "its mHC residual and grouped output projection are not built for scattered rows"


# its sliding-window ring folds every token in: not positional
@register_model("deepseek_v4", DeepseekV4Config, architectures=("DeepseekV4ForCausalLM",),
                check_parallel=check_parallel,
                boundary_reduction="rs+rsv", positional_cache=False, moe_a2a=True,
                attn_input_scattered=NO_QKV_LATENT, context_parallel=NO_CP, sequence_parallel=NO_SP,
                batch_invariant=True)
class DeepseekV4ForCausalLM(CausalLM):
    """DeepSeek-V4: an mHC residual of ``hc_mult`` copies, windowed attention with sinks,
    hash-routed then scored MoE layers."""

    layer_cls = DeepseekV4DecoderLayer
    transformers_names = TRANSFORMERS_NAMES

    @staticmethod
    def final_norm(cfg: DeepseekV4Config, dtype) -> MhcFinalNorm:
        # the stack leaves through the HyperHead's collapse of the streams, then the norm
        return MhcFinalNorm(HyperHead(cfg.hidden_size, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps),
                            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype))

    def cache_layout(self) -> CacheLayout:
        # one head a token, read as both keys and values, in a ring of the window
        return CacheLayout(dict.fromkeys(self.stage.layers, (1, self.config.head_dim)),
                           window=self.config.sliding_window, shared_kv=True)

    def stacked_params(self) -> list:
        return expert_stacked_params(self.config.n_routed_experts)

    def checkpoint_name(self, name: str) -> str | None:
        """This model's parameter name for an on-disk tensor name (None: not loaded)."""
        if name.startswith(("mtp.", "model.mtp.")):
            return None  # multi-token-prediction layers (transformers ignores them too)
        m = _LAYER.match(name)
        if m:
            rest = m.group(2)
            for pattern, repl in _LAYER_RENAMES:
                rest, hit = pattern.subn(repl, rest)
                if hit:
                    break
            return f"model.layers.{m.group(1)}.{rest}"
        m = _HEAD.match(name)
        if m:
            return f"{HEAD_PREFIX}.hc_{m.group(2)}"
        if name in ("norm.weight", "model.norm.weight"):
            return f"{NORM_PREFIX}.weight"
        return {"embed.weight": "model.embed_tokens.weight",
                "head.weight": "lm_head.weight"}.get(name, name)

    def load_weights(self, weights) -> None:
        super().load_weights(weights)
        experts = self.config.n_routed_experts
        for i, layer in zip(self.stage.layers, self.model.layers):
            table = getattr(layer.mlp.gate, "tid2eid", None)
            if table is not None and (table.min() < 0 or table.max() >= experts):
                raise CheckpointError(
                    f"checkpoint tensor model.layers.{i}.ffn.gate.tid2eid holds expert ids "
                    f"outside 0..{experts - 1} (n_routed_experts={experts})")
