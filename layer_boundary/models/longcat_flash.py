"""Meituan LongCat-Flash (shortcut-connected MoE with zero-computation experts) with layer
boundaries. Compute is plain PyTorch; parameter names follow the Hugging Face checkpoint
(``model.layers.N.self_attn.{0,1}.*``, ``mlps.{0,1}.*``, ``mlp.router.*``), except the routed
experts, which are fused per rank (``mlp.experts.w13``/``w2``) at load time.

One decoder layer (transformers' ``LongcatFlashDecoderLayer``; ``num_hidden_layers`` is
``2 * num_layers``, one per attention)::

    r = x + attn0(in_norm0(x)); h = post_norm0(r); moe = MoE(h)
    r = r + mlp0(h); r = r + attn1(in_norm1(r)); out = r + mlp1(post_norm1(r)) + moe

Boundaries: attention 0 and the MoE are the layer's main line on the layer stack; mlp0,
attention 1 and mlp1 are a prepared branch (``prepared_from`` the MoE's stage) that reads the MoE's
prepared input through ``branch_input``, runs on its own residual stream and merges back with
``merge_branch``: the branch's complete output joins the MoE's pending partial on one
attention-TP rank, so the next layer's attention input completes both with the MoE's one sum.

Parallelism:

* MLA (two per layer) over attention TP, as DeepSeek-V3's (``DeepseekV3Attention``, whose
  latent projections run as the stage's ``qkv_latent_func`` before any row gather), plus
  LongCat's LoRA scales: q (both parts) times ``(hidden / q_lora_rank) ** 0.5``, the normed
  kv latent times ``(hidden / kv_lora_rank) ** 0.5``; q always through q LoRA; interleaved
  rope over ``qk_rope_head_dim`` (transformers builds it with ``head_dim``: the two must agree).
  Output projection row-parallel without a reduction (PARTIAL). Attention ``2 i + k`` owns KV
  cache layer ``2 i + k``.
* Dense FFNs (``mlps``): SwiGLU over the full TP group.
* MoE: a replicated fp32 softmax router over ``n_routed_experts + zero_expert_num`` scores,
  top-k by the scores plus ``e_score_correction_bias``, weights the chosen unbiased scores x
  ``routed_scaling_factor`` (not renormalised); routed experts in ``FusedMoE`` over
  ``moe_ep x moe_tp``; zero (identity) experts add ``x * weight``, carried by TP rank 0 into
  the MoE output's one sum (``FusedMoE(zero_experts=...)``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import (append_stages, branch_input, branch_output, declare_attn, declare_ffn,
                merge_branch)
from ..runtime import BoundaryRuntime, RMSNorm
from ..runtime.hf_names import StackExperts
from .base import CausalLM
from .deepseek_v3 import (DeepseekV3Attention, DeepseekV3MLP, ReplicatedLinear, mla_layout,
                          mla_rope)
from .kv_cache import CacheLayout
from .config import (BOOL, NON_NEGATIVE_INT, POSITIVE_INT, POSITIVE_NUMBER, CheckedConfig,
                     CheckpointError, check_divisible, require, theta_of)
from .registry import register_model
from .moe import FusedMoE, expert_stacked_params
from .settings import Derived, Null, setting

# transformers' defaults for fields a config.json may leave out (LongcatFlashConfig)
DEFAULT_ROPE_THETA = 1e7
DEFAULT_ZERO_EXPERTS = 256


@dataclass(frozen=True)
class LongcatFlashConfig(CheckedConfig):
    """The decoder's sizes (each under its canonical name or transformers' alias), the dense
    FFNs', the MoE's (its routed and zero experts), the MLA's and the rope's theta."""

    vocab_size: int = setting()
    hidden_size: int = setting()
    num_layers: int = setting(check=POSITIVE_INT)  # decoder layers; each holds two attentions
    num_attention_heads: int = setting()
    ffn_hidden_size: int = setting(check=POSITIVE_INT,
                                   names=("ffn_hidden_size", "intermediate_size"))
    expert_ffn_hidden_size: int = setting(
        check=POSITIVE_INT, names=("expert_ffn_hidden_size", "moe_intermediate_size"))
    n_routed_experts: int = setting(names=("n_routed_experts", "num_local_experts"))
    # transformers' default; a null (NOT_NULL: refused by validate) reads as none
    zero_expert_num: int = setting(DEFAULT_ZERO_EXPERTS, NON_NEGATIVE_INT, null=Null.DERIVE,
                                   derive=Derived(lambda v: 0, "no zero experts"))
    moe_topk: int = setting(check=POSITIVE_INT, names=("moe_topk", "num_experts_per_tok"))
    q_lora_rank: int = setting(check=POSITIVE_INT)
    kv_lora_rank: int = setting(check=POSITIVE_INT)
    qk_nope_head_dim: int = setting(check=POSITIVE_INT)
    qk_rope_head_dim: int = setting(check=POSITIVE_INT)
    v_head_dim: int = setting(check=POSITIVE_INT)
    routed_scaling_factor: float = setting(6.0, POSITIVE_NUMBER)
    rms_norm_eps: float = setting(1e-5)
    rope_theta: float = DEFAULT_ROPE_THETA
    tie_word_embeddings: bool = setting(False)
    attention_bias: bool = setting(False, BOOL)
    model_type: str = "longcat_flash"

    checks = {"norm_topk_prob": BOOL, "router_bias": BOOL}
    expert_fields = ("n_routed_experts", "num_local_experts")
    top_k_fields, extra_expert_field = ("num_experts_per_tok",), "zero_expert_num"
    # what DeepseekV3Attention reads: LongCat's MLA always has q LoRA and interleaved rope
    rope_interleave: bool = True

    @property
    def num_hidden_layers(self) -> int:
        """Attention layers (transformers' ``num_hidden_layers``): two per decoder layer."""
        return 2 * self.num_layers

    @property
    def num_experts_per_tok(self) -> int:
        return self.moe_topk

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def q_latent_dim(self) -> int:
        return self.q_lora_rank

    @property
    def softmax_scale(self) -> float:
        # transformers: yarn_apply_mscale(rope_parameters, qk_head_dim ** -0.5), which changes
        # the scale only under a non-default rope type (rejected by from_dict)
        return self.qk_head_dim ** -0.5

    @classmethod
    def read(cls, cfg: dict) -> dict:
        """What the model does not compute refused by name (a rope type, a quantized
        checkpoint, an activation, the router's bias), the decoder layers (transformers'
        ``num_hidden_layers`` halved where config.json gives only that), then the declared
        settings, their agreement (the MLA's widths, the experts a token picks) and the
        rope's theta."""
        rope = mla_rope(cfg)
        if cfg.get("router_bias"):
            raise CheckpointError(
                "config.json router_bias true is not supported (transformers' LongCat-Flash "
                "router allocates the classifier bias but never adds it)")
        layers = {}
        if "num_hidden_layers" in cfg and "num_layers" not in cfg:
            # transformers' setter: num_layers = num_hidden_layers // 2
            attn_layers = require(cfg, "num_hidden_layers")
            if attn_layers % 2:
                raise CheckpointError(f"config.json num_hidden_layers={attn_layers} must be even "
                                      "(two attentions per decoder layer)")
            layers = {"num_layers": attn_layers // 2}
        values = super().read({**cfg, **layers})
        heads, hidden = values["num_attention_heads"], values["hidden_size"]
        kv_heads = cfg.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != heads:
            raise CheckpointError(f"config.json num_key_value_heads={kv_heads} must equal "
                                  f"num_attention_heads={heads} (MLA expands keys per head)")
        nope, rope_dim = values["qk_nope_head_dim"], values["qk_rope_head_dim"]
        if rope_dim % 2:
            raise CheckpointError(f"config.json qk_rope_head_dim={rope_dim} must be even")
        qk_head_dim = cfg.get("qk_head_dim")
        if qk_head_dim is not None and qk_head_dim != nope + rope_dim:
            raise CheckpointError(f"config.json qk_head_dim={qk_head_dim} must equal "
                                  f"qk_nope_head_dim + qk_rope_head_dim = {nope + rope_dim}")
        # transformers builds the rotary embedding with head_dim (default 64, or hidden/heads
        # when null) and applies it to qk_rope_head_dim channels
        head_dim = cfg.get("head_dim", 64) or hidden // heads
        if head_dim != rope_dim:
            raise CheckpointError(f"config.json head_dim={head_dim} must equal "
                                  f"qk_rope_head_dim={rope_dim} (the rotary embedding is built "
                                  "with head_dim and applied to the rope channels)")
        experts, zero, top_k = (values[f] for f in ("n_routed_experts", "zero_expert_num",
                                                    "moe_topk"))
        if top_k > experts + zero:
            raise CheckpointError(f"config.json moe_topk={top_k} exceeds n_routed_experts + "
                                  f"zero_expert_num = {experts + zero}")
        return dict(values, rope_theta=theta_of(rope, cfg, DEFAULT_ROPE_THETA))


def check_parallel(cfg: LongcatFlashConfig, dims) -> None:
    """Reject a topology this config cannot be sharded over, naming the config field."""
    check_divisible("num_attention_heads", cfg.num_attention_heads, "attention tp", dims.attn_tp)
    check_divisible("ffn_hidden_size", cfg.ffn_hidden_size, "tp", dims.tp)
    check_divisible("n_routed_experts", cfg.n_routed_experts, "moe_ep", dims.moe_ep)
    check_divisible("expert_ffn_hidden_size", cfg.expert_ffn_hidden_size, "moe_tp", dims.moe_tp)


class LongcatFlashAttention(DeepseekV3Attention):
    """DeepSeek-V3's MLA with LongCat's LoRA scales on q and on the normed kv latent."""

    def __init__(self, cfg: LongcatFlashConfig, layer_id: int, runtime: BoundaryRuntime, dtype):
        super().__init__(cfg, layer_id, runtime, dtype)
        self.mla_scale_q_lora = (cfg.hidden_size / cfg.q_lora_rank) ** 0.5
        self.mla_scale_kv_lora = (cfg.hidden_size / cfg.kv_lora_rank) ** 0.5

    def project_q(self, q_lat: torch.Tensor) -> torch.Tensor:
        return super().project_q(q_lat) * self.mla_scale_q_lora

    def latent(self, kv_nope: torch.Tensor) -> torch.Tensor:
        return self.kv_a_layernorm(kv_nope) * self.mla_scale_kv_lora


class LongcatFlashRouter(nn.Module):
    """Softmax over routed + zero experts' logits (fp32); the correction bias steers only the
    choice; weights are the chosen unbiased scores x ``routed_scaling_factor``."""

    def __init__(self, cfg: LongcatFlashConfig):
        super().__init__()
        total = cfg.n_routed_experts + cfg.zero_expert_num
        self.top_k, self.scale = cfg.moe_topk, cfg.routed_scaling_factor
        self.classifier = ReplicatedLinear(cfg.hidden_size, total, dtype=torch.float32)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(total, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64)."""
        scores = F.linear(x.float(), self.classifier.weight.float()).softmax(dim=-1)
        choice = scores + self.e_score_correction_bias
        topk_ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        return scores.gather(1, topk_ids) * self.scale, topk_ids


class LongcatFlashMoE(nn.Module):
    def __init__(self, cfg: LongcatFlashConfig, runtime: BoundaryRuntime, dtype):
        super().__init__()
        self.router = LongcatFlashRouter(cfg)
        self.experts = FusedMoE(cfg.n_routed_experts, cfg.hidden_size,
                                cfg.expert_ffn_hidden_size, runtime.parallel, dtype,
                                zero_experts=cfg.zero_expert_num,
                                dispatch=runtime.dispatches_moe)

    def forward(self, x: torch.Tensor):
        """x: [T, H] (every DP rank's rows): a partial over TP, a finalize handoff or the
        complete output, as the exit's flags ask (identity experts included once)."""
        topk_weights, topk_ids = self.router(x)
        return self.experts(x, topk_ids, topk_weights)


class LongcatFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: LongcatFlashConfig, i: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.mlp = LongcatFlashMoE(cfg, runtime, dtype)
        self.self_attn = nn.ModuleList(LongcatFlashAttention(cfg, 2 * i + k, runtime, dtype)
                                       for k in range(2))
        self.mlps = nn.ModuleList(DeepseekV3MLP(cfg.hidden_size, cfg.ffn_hidden_size, runtime,
                                                dtype) for _ in range(2))
        self.input_layernorm = nn.ModuleList(RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                     dtype=dtype) for _ in range(2))
        self.post_attention_layernorm = nn.ModuleList(
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype) for _ in range(2))
        opts = {} if fusions is None else {"fusions": fusions}
        latent = [{"qkv_latent_func": attn.prepare_qkv_latent, **opts} for attn in self.self_attn]
        attn0, moe = self.declarations(cfg, i, runtime)
        self.attn0_boundary, self.moe_boundary = append_stages(
            (attn0, self.input_layernorm[0], latent[0]),
            (moe, self.post_attention_layernorm[0], opts), name=f"layer{i}")
        # merged back into the MoE's output before the next layer: the stack binds the
        # branch's last stage with the MoE's consumer
        self.mlp0_boundary, self.attn1_boundary, self.mlp1_boundary = append_stages(
            # the entry stage reads the MoE's prepared input: its norm is never applied
            (declare_ffn(), self.post_attention_layernorm[0], opts),
            (declare_attn(), self.input_layernorm[1], latent[1]),
            (declare_ffn(), self.post_attention_layernorm[1], opts),
            prepared_from=self.moe_boundary, name=f"layer{i}.branch")

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        """The main line: attention 0 (PARTIAL), then the MoE, whose output carries the
        merged branch into the next layer (so the next layer names the MoE as its producer)."""
        return declare_attn(), declare_ffn(sparse=True, dispatches=runtime.dispatches_moe)

    def stage_compute(self) -> list:
        """(stage, compute module name) of each stage this layer holds."""
        return [(self.attn0_boundary, "self_attn.0"), (self.moe_boundary, "mlp"),
                (self.mlp0_boundary, "mlps.0"), (self.attn1_boundary, "self_attn.1"),
                (self.mlp1_boundary, "mlps.1")]

    def _attention(self, k: int, latent, positions, forward_batch):
        if latent.shape[0] == 0:  # no rows on this DP rank: an empty contribution
            return latent.new_zeros((0, self.hidden_size))
        return self.self_attn[k](positions, latent, forward_batch)

    def forward(self, positions, hidden_states, forward_batch):
        fb = forward_batch
        h = self.attn0_boundary.prepare(hidden_states, fb)  # qkv latent of attention 0
        # each attention inside its exit scope, which publishes each row's LoRA adapter to
        # its linears (finish() alone left an adapted o_proj none: a RuntimeError mid-forward)
        with self.attn0_boundary.exit(fb) as output:
            a = self._attention(0, h, positions, fb)
        h = output.finish(a)

        h = self.moe_boundary.prepare(h, fb)  # post_attention_layernorm[0] on global rows
        with self.moe_boundary.exit(fb) as output:
            moe = self.mlp(h)
        moe = output.finish(moe)

        x = branch_input(self.moe_boundary, h, fb)  # the same input, for the dense branch
        with self.mlp0_boundary.exit(fb) as output:
            y = self.mlps[0](x)
        y = output.finish(y)
        y = self.attn1_boundary.prepare(y, fb)
        with self.attn1_boundary.exit(fb) as output:
            a = self._attention(1, y, positions, fb)
        y = output.finish(a)
        y = self.mlp1_boundary.prepare(y, fb)
        with self.mlp1_boundary.exit(fb) as output:
            z = self.mlps[1](y)
        y = branch_output(output.finish(z), fb)
        return merge_branch(moe, y, fb)


# identity experts keep (unused) gate/up projections on disk: transformers allocates
# gate_up_proj for routed + zero experts but runs only the routed ones
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


NO_CP = ("its dense FFNs and second attention run as a prepared branch, which takes ordinary "
         "token rows only")
NO_SP = ("its MLA latent projections are replicated over attention TP, and its branch takes "
         "ordinary token rows only")


@register_model("longcat_flash", LongcatFlashConfig, architectures=("LongcatFlashForCausalLM",),
                context_parallel=NO_CP,
                sequence_parallel=NO_SP, attn_input_scattered=True, moe_a2a=True,
                check_parallel=check_parallel, boundary_reduction="rs+rsv", positional_cache=True,
                batch_invariant=True)
class LongcatFlashForCausalLM(CausalLM):
    """LongCat-Flash: per layer two MLA attentions and two dense MLPs beside a MoE with
    identity experts (the branch of the first attention's output)."""

    layer_cls = LongcatFlashDecoderLayer
    # (a tp 2 dp 2 request: 8e-7 apart on DP rank 1)
    batch_invariant_dp = ("its dense branch's output is added on one of its DP rank's ranks "
                          "into the MoE's sum over TP still owed, so where it enters the sum, "
                          "and a request's last bits, follow the DP rank a batch puts it on")
    # transformers' qwen2_moe conversion; its gate_up_proj holds the identity experts' rows too
    # (n_routed_experts + zero_expert_num), which the checkpoint may store, and no forward reads
    transformers_names = (
        StackExperts(("gate_proj", "up_proj"), "gate_up_proj",
                     count=("n_routed_experts", "zero_expert_num")),
        StackExperts(("down_proj",), "down_proj", count=("n_routed_experts",)))

    def cache_layout(self) -> CacheLayout:
        # attention 2 i + k of decoder layer i owns KV-cache layer 2 i + k
        return mla_layout(self.config, [2 * i + k for i in self.stage.layers for k in range(2)])

    @staticmethod
    def decoder_layers(cfg: LongcatFlashConfig) -> int:
        return cfg.num_layers

    def stacked_params(self) -> list:
        return expert_stacked_params(self.config.n_routed_experts)

    def skipped_params(self) -> tuple:
        # multi-token-prediction tensors (transformers ignores model.mtp.* on load)
        return super().skipped_params() + ("model.mtp.",)

    def checkpoint_name(self, name: str) -> str | None:
        m = _EXPERT.search(name)  # an identity expert's stored rows: not loaded
        return None if m and int(m.group(1)) >= self.config.n_routed_experts else name

    def load_weights(self, weights) -> None:
        routed = self.config.n_routed_experts
        super().load_weights((name, t) for name, t in weights
                             if not ((m := _EXPERT.search(name)) and int(m.group(1)) >= routed))
