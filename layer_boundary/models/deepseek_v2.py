"""DeepSeek-V2 (MLA attention, softmax-routed MoE with shared experts) with layer boundaries.

DeepSeek-V3's blocks (``deepseek_v3.py``) with V2's router: the attention (MLA with or
without q LoRA: transformers' DeepseekV2Config defaults to q LoRA, V2-Lite has none and
projects q with ``q_proj``), the latent KV cache, the dense first layers, the shared experts
and the routed experts over ``moe_ep x moe_tp`` are V3's, imported. What differs is the gate:

* scores are a softmax over the experts (fp32), not sigmoids, and there is no
  ``e_score_correction_bias``;
* ``topk_method`` "greedy": the top-k scores; "group_limited_greedy": the experts split into
  ``n_group`` groups, a group scored by its best expert, the ``topk_group`` best groups kept,
  the top-k scores inside them;
* the weights are the chosen scores times ``routed_scaling_factor``, never renormalized
  (transformers' router ignores ``norm_topk_prob``, so a checkpoint asking for it is refused
  rather than served two ways).

Rope: the default rope on ``qk_rope_head_dim`` interleaved pairs (transformers rotates them as
complex numbers, the V3 ``rope_interleave`` layout). The released V2 checkpoints use YaRN
rope scaling, refused by name (``deepseek_v3.mla_rope``), as V3's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import (BOOL, POSITIVE_NUMBER, CheckpointError, check_grouped_router,
                     check_unquantized_silu, require)
from .deepseek_v3 import (NO_SP, DeepseekV3Config, DeepseekV3DecoderLayer, DeepseekV3ForCausalLM,
                          DeepseekV3MoE, check_parallel)
from .registry import register_model
from .settings import setting

TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class DeepseekV2Config(DeepseekV3Config):
    """V3's fields (MLA, experts, dense first layers) and V2's ``topk_method``; ``n_group`` and
    ``topk_group`` are read for group_limited_greedy only (1 under greedy)."""

    topk_method: str = "greedy"
    norm_topk_prob: bool = setting(False, BOOL)  # refused where true
    routed_scaling_factor: float = setting(1.0, POSITIVE_NUMBER)
    rope_interleave: bool = True  # no such field: V2's rope is always interleaved
    model_type: str = "deepseek_v2"

    checks = {"mlp_bias": BOOL}

    @classmethod
    def read(cls, cfg: dict) -> dict:
        """What V2 does not compute refused by name (a quantized checkpoint, an activation,
        MLP biases, a router but softmax's, a top-k method, renormalized weights), the router's
        groups (group_limited_greedy's), then V3's reader on the rest: V2 has no sigmoid
        scores and no rope_interleave field (its rope is always interleaved)."""
        check_unquantized_silu(cfg)
        if cfg.get("mlp_bias"):
            raise CheckpointError("config.json mlp_bias=true is not supported (the MLPs and "
                                  "experts have no biases)")
        scoring = cfg.get("scoring_func", "softmax")  # the released config.json files say it
        if scoring != "softmax":
            raise CheckpointError(f"config.json scoring_func {scoring!r} is not supported "
                                  "(softmax only, as transformers' DeepseekV2 router)")
        method = cfg.get("topk_method") or "greedy"
        if method not in TOPK_METHODS:
            raise CheckpointError(f"config.json topk_method {method!r} is not supported "
                                  f"({', '.join(TOPK_METHODS)} only)")
        if cfg.get("norm_topk_prob"):
            raise CheckpointError("config.json norm_topk_prob=true is not supported "
                                  "(transformers' DeepseekV2 router never renormalizes the "
                                  "top-k weights; the original code would)")
        experts = require(cfg, "n_routed_experts")
        top_k = require(cfg, "num_experts_per_tok")
        n_group = topk_group = 1
        if method == "group_limited_greedy":
            n_group, topk_group = require(cfg, "n_group"), require(cfg, "topk_group")
            # a group scored by its best expert: one expert a group is enough here (V3's
            # check asks for two, which V3's top-2 group scores need)
            check_grouped_router(experts, n_group, topk_group, top_k, min_group=1)
        values = super().read({**cfg, "scoring_func": "sigmoid", "n_group": 1, "topk_group": 1})
        return dict(values, topk_method=method, n_group=n_group, topk_group=topk_group)


class DeepseekV2Router(nn.Module):
    """Softmax scores over the experts; the top-k (inside the ``topk_group`` groups whose best
    score is highest, under group_limited_greedy), weighted by their scores times
    ``routed_scaling_factor``. fp32, as transformers keeps the router."""

    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        self.top_k, self.num_experts = cfg.num_experts_per_tok, cfg.n_routed_experts
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.grouped = cfg.topk_method == "group_limited_greedy"
        self.scale = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size,
                                               dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64)."""
        scores = F.linear(x.float(), self.weight).softmax(dim=-1)  # [T, E]
        if self.grouped:
            grouped = scores.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.max(dim=-1).values  # [T, n_group]
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
            scores = scores.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), 0.0)
        topk_weights, topk_ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return topk_weights * self.scale, topk_ids


class DeepseekV2MoE(DeepseekV3MoE):
    """V3's MoE block (routed experts, shared experts, their shared reduction) with V2's gate."""

    router_cls = DeepseekV2Router


class DeepseekV2DecoderLayer(DeepseekV3DecoderLayer):
    """V3's layer (MLA, then the dense MLP or the MoE) with V2's MoE."""

    moe_cls = DeepseekV2MoE


@register_model("deepseek_v2", DeepseekV2Config, architectures=("DeepseekV2ForCausalLM",),
                check_parallel=check_parallel,
                # without q LoRA the q latent is the normalized input itself (q_proj is
                # head-sharded), with it q_a_proj's output: either way the latent V3 moves
                sequence_parallel=NO_SP, attn_input_scattered=True, moe_a2a=True,
                boundary_reduction="rs+rsv", positional_cache=True, context_parallel=True,
                batch_invariant=True)
class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2: V3's skeleton (latent KV cache, fused experts) with V2's layers."""

    layer_cls = DeepseekV2DecoderLayer
