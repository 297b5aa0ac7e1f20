"""MiniMax-M2 with layer boundaries: GQA whose q and k are RMS-normalised over every head of
their projection (``q_norm`` over ``heads * head_dim``, ``k_norm`` over ``kv_heads *
head_dim``: ``HeadsRMSNorm``, the squares summed over attention TP, replicated kv heads counted
once), a partial rotary embedding (the first ``rotary_dim`` dims of each head), then a sparse
MoE FFN on every layer: sigmoid scores over the experts, ``e_score_correction_bias`` added
for the choice of the top k only, the weights the chosen experts' unbiased scores divided by
their sum; SwiGLU experts of ``intermediate_size``, no shared experts.

The checkpoint layout is Mixtral's (``block_sparse_moe``, experts' w1/w3/w2), with the bias
beside the router as ``block_sparse_moe.e_score_correction_bias``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.args import BoundaryRuntime
from .config import (BOOL, NON_NEGATIVE_INT, POSITIVE_INT, POSITIVE_NUMBER, STRING,
                     CheckpointError, default_rope, theta_of)
from .layers import GqaAttention
from .llama import LlamaConfig
from .mixtral import (EXPERT_NAMES, MixtralDecoderLayer, MixtralForCausalLM,
                      check_moe_parallel)
from .moe import FusedMoE
from .registry import dense, register_model
from .rope import inverse_frequencies
from .settings import Null, setting


def rotary_dims(cfg: dict, head_dim: int) -> int:
    """The rotating dims of a head, as transformers reads them: ``rope_parameters``'
    ``partial_rotary_factor``, else the top-level one, else ``rotary_dim / head_dim``, else
    the whole head; ``int(head_dim * factor)``, a positive even number."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if factor is None and cfg.get("rotary_dim") is not None:
        factor = cfg["rotary_dim"] / head_dim
    if factor is None:
        return head_dim
    if not POSITIVE_NUMBER.ok(factor):
        raise CheckpointError(f"config.json partial_rotary_factor must be "
                              f"{POSITIVE_NUMBER.what}, got {factor!r}")
    dims = int(head_dim * factor)
    if dims < 2 or dims % 2 or dims > head_dim:
        raise CheckpointError(f"config.json partial_rotary_factor={factor} gives {dims} rotary "
                              f"dims of head_dim={head_dim} (a positive even number up to "
                              "head_dim is needed)")
    return dims


def refuse_contrary(cfg: dict) -> None:
    """Fields of MiniMax's own config.json that transformers ignores, refused by name where
    they describe another model than the one computed here."""
    wants = {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
             "use_routing_bias": True}
    for field, value in wants.items():
        if cfg.get(field) is not None and cfg[field] != value:
            raise CheckpointError(f"config.json {field}={cfg[field]!r} is not supported "
                                  f"({value!r} only)")
    if cfg.get("shared_intermediate_size"):
        raise CheckpointError(f"config.json shared_intermediate_size="
                              f"{cfg['shared_intermediate_size']} is not supported (MiniMax-M2 "
                              "has no shared experts)")


@dataclass(frozen=True)
class MiniMaxM2Config(LlamaConfig):
    """Llama's dense fields (no biases, the default rope, transformers' MiniMax-M2 defaults),
    the rotary dims of a head, and the experts: ``num_experts`` (``num_local_experts``) of
    ``intermediate_size`` each, ``num_experts_per_tok`` chosen per token."""

    head_dim: int = setting(128, null=Null.DEFAULT)
    rope_theta: float = 5e6
    # transformers' MiniMax-M2 has no biases: it reads neither attention_bias nor mlp_bias
    attention_bias: bool = False
    mlp_bias: bool = False
    rotary_dim: int = 0
    num_experts: int = setting(names=EXPERT_NAMES)
    num_experts_per_tok: int = setting()
    model_type: str = "minimax_m2"

    checks = {"rotary_dim": POSITIVE_INT, "use_qk_norm": BOOL, "use_routing_bias": BOOL,
              "qk_norm_type": STRING, "shared_intermediate_size": NON_NEGATIVE_INT}
    expert_fields, top_k_fields = EXPERT_NAMES, ("num_experts_per_tok",)

    @classmethod
    def refuse(cls, cfg: dict) -> None:
        super().refuse(cfg)
        refuse_contrary(cfg)

    @classmethod
    def read_rope_fields(cls, cfg: dict, values: dict) -> dict:
        """The default rope's theta, and the rotary dims of a head (a partial rotary)."""
        theta = theta_of(default_rope(cfg), cfg, cls.default_of("rope_theta"))
        return {"rope_theta": theta, "rotary_dim": rotary_dims(cfg, values["head_dim"])}

    def is_sparse(self, layer_id: int) -> bool:
        """Every layer's FFN is the MoE."""
        return 0 <= layer_id < self.num_hidden_layers


class MiniMaxM2Router(nn.Module):
    """Sigmoid scores in fp32; the bias steers the choice only; the weights are the chosen
    experts' unbiased scores normalised to sum 1 (fp32, as transformers keeps them)."""

    def __init__(self, cfg: MiniMaxM2Config, dtype):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor):
        """x: [T, H], bias: [E] -> (weights [T, k] fp32, ids [T, k])."""
        scores = torch.sigmoid(F.linear(x, self.weight).float())  # [T, E]
        ids = torch.topk(scores + bias, self.top_k, dim=-1, sorted=False)[1]  # [T, k]
        weights = scores.gather(1, ids)
        return weights / weights.sum(dim=-1, keepdim=True), ids


class MiniMaxM2SparseMoeBlock(nn.Module):
    """The router, its selection bias (``e_score_correction_bias``, held by the block as the
    checkpoint holds it) and the experts over ``moe_ep x moe_tp`` (dispatched all-to-all
    when the runtime asks)."""

    def __init__(self, cfg: MiniMaxM2Config, runtime: BoundaryRuntime, dtype):
        super().__init__()
        self.gate = MiniMaxM2Router(cfg, dtype)
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(cfg.num_experts, dtype=torch.float32), requires_grad=False)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size,
                                runtime.parallel, dtype, dispatch=runtime.dispatches_moe)

    def forward(self, x):
        weights, ids = self.gate(x, self.e_score_correction_bias)
        return self.experts(x, ids, weights)  # reduced, partial, or a finalize handoff


class MiniMaxM2DecoderLayer(MixtralDecoderLayer):
    """Mixtral's layer with q/k norms over every head and a partial rotary embedding in the
    attention, and the bias-steered sigmoid router in the MoE."""

    @staticmethod
    def make_attention(cfg: MiniMaxM2Config, layer_id: int, runtime: BoundaryRuntime, dtype):
        return GqaAttention.of(cfg, layer_id, runtime, dtype, qk_norm_eps=cfg.rms_norm_eps,
                               qk_norm_width="hf", rotary_dim=cfg.rotary_dim,
                               inv_freq=inverse_frequencies(cfg.rope_theta, cfg.rotary_dim))

    @staticmethod
    def make_moe(cfg: MiniMaxM2Config, runtime: BoundaryRuntime, dtype):
        return MiniMaxM2SparseMoeBlock(cfg, runtime, dtype)


@register_model("minimax_m2", MiniMaxM2Config, architectures=("MiniMaxM2ForCausalLM",),
                **dense(check_parallel=check_moe_parallel, moe_a2a=True))
class MiniMaxM2ForCausalLM(MixtralForCausalLM):
    """Mixtral's skeleton and checkpoint layout with MiniMax-M2's layers."""

    layer_cls = MiniMaxM2DecoderLayer
