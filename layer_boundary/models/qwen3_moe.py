"""Qwen3-MoE: Qwen3 attention with sparse (softmax top-k) expert FFNs on most layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import declare_ffn
from ..runtime.args import BoundaryRuntime
from ..runtime.hf_names import GATE_UP_EXPERTS, MLP_ROUTER
from .config import EXPERTS, INT_LIST, POSITIVE_INT, check_tp, quantized_read
from .registry import dense, register_model
from ..runtime.quant import fake_quantize
from .layers import QKV_PARAMS
from .llama import LlamaForCausalLM
from .moe import FusedMoE, expert_stacked_params, experts_fp8_group
from .qwen3 import Qwen3Config, Qwen3DecoderLayer
from .settings import setting


@dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3's fields and the experts: ``num_experts`` of ``moe_intermediate_size`` each,
    ``num_experts_per_tok`` chosen per token, on every ``decoder_sparse_step``-th layer but
    ``mlp_only_layers``."""

    moe_intermediate_size: int = setting()
    # transformers writes num_local_experts; released checkpoints num_experts
    num_experts: int = setting(names=("num_experts", "num_local_experts"))
    num_experts_per_tok: int = setting()
    norm_topk_prob: bool = setting(False, EXPERTS["norm_topk_prob"])
    decoder_sparse_step: int = setting(1, POSITIVE_INT)
    mlp_only_layers: tuple = setting((), INT_LIST)
    model_type: str = "qwen3_moe"

    checks = {"routed_scaling_factor": EXPERTS["routed_scaling_factor"]}
    expert_fields, top_k_fields = ("num_experts", "num_local_experts"), ("num_experts_per_tok",)

    def is_sparse(self, layer_id: int) -> bool:
        return (0 <= layer_id < self.num_hidden_layers and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)


def check_parallel(cfg: Qwen3MoeConfig, dims) -> None:
    check_tp(cfg, dims.attn_tp, dims.tp)
    if cfg.num_experts % dims.moe_ep:
        raise ValueError(f"num_experts={cfg.num_experts} is not divisible by ep={dims.moe_ep}")
    if cfg.moe_intermediate_size % dims.moe_tp:
        raise ValueError(f"moe_intermediate_size={cfg.moe_intermediate_size} is not divisible by "
                         f"the MoE tensor-parallel size tp/ep={dims.moe_tp}")


class Qwen3MoeRouter(nn.Module):
    """Softmax over experts, top-k, optionally renormalised; scores in fp32 as HF."""

    def __init__(self, cfg: Qwen3MoeConfig, dtype):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype),
                                   requires_grad=False)

    def forward(self, x):
        logits = F.linear(x, self.weight)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids


class Qwen3MoeSparseBlock(nn.Module):
    """``fp8_group``: an FP8 checkpoint's experts read the input quantized in groups of that
    many channels (``moe.experts_fp8_group``); the router reads it unquantized."""

    def __init__(self, cfg: Qwen3MoeConfig, runtime: BoundaryRuntime, dtype,
                 fp8_group: int | None = None):
        super().__init__()
        self.fp8_group = fp8_group
        self.gate = Qwen3MoeRouter(cfg, dtype)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                runtime.parallel, dtype, dispatch=runtime.dispatches_moe)

    def forward(self, x):
        weights, ids = self.gate(x)
        if self.fp8_group is not None:
            x = fake_quantize(x, self.fp8_group)
        return self.experts(x, ids, weights)  # reduced, partial, or a finalize handoff


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """Qwen3's layer with the experts' block on its sparse layers."""

    def make_mlp(self, cfg: Qwen3MoeConfig, layer_id: int, runtime: BoundaryRuntime, dtype):
        if cfg.is_sparse(layer_id):
            return Qwen3MoeSparseBlock(cfg, runtime, dtype,
                                       experts_fp8_group(cfg, layer_id, cfg.num_experts))
        return super().make_mlp(cfg, layer_id, runtime, dtype)

    @staticmethod
    def ffn_declaration(cfg: Qwen3MoeConfig, layer_id: int, runtime: BoundaryRuntime):
        # the dense layers' gated MLPs are sequence-parallel; the experts are not (in a
        # sequence-parallel batch the boundary gathers their input and reduce-scatters the sum)
        sparse = cfg.is_sparse(layer_id)
        # an FP8 checkpoint's dense MLPs read quantized inputs; a MoE's router reads the
        # unquantized one, so its experts quantize it themselves (Qwen3MoeSparseBlock)
        read = None if sparse else quantized_read(cfg, layer_id, ("mlp.gate_proj",
                                                                  "mlp.up_proj"))
        return declare_ffn(sparse=sparse, next_sparse=cfg.is_sparse(layer_id + 1),
                           sequence_parallel=not sparse,
                           dispatches=sparse and runtime.dispatches_moe,
                           read=read)


@register_model("qwen3_moe", Qwen3MoeConfig, architectures=("Qwen3MoeForCausalLM",),
                **dense(check_parallel=check_parallel, moe_a2a=True))
class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3's attention before MoE FFNs (a gated MLP where the layer is dense); the experts'
    weights load stacked after q/k/v."""

    layer_cls = Qwen3MoeDecoderLayer
    # transformers' qwen2_moe conversion: each layer's experts stacked into
    # experts.gate_up_proj and experts.down_proj; the router is no nn.Linear
    transformers_names = (*GATE_UP_EXPERTS, MLP_ROUTER)

    def stacked_params(self) -> list:
        return [*QKV_PARAMS, *expert_stacked_params(self.config.num_experts)]
